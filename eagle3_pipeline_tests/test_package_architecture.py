"""No module of the package imports, directly or through others, a module that imports it back.

The graph is read from the source with ``ast`` (nothing is imported): an edge for every ``import``
and ``from … import`` (absolute or relative) of a module of ``eagle3_pipeline``, at module level or
inside a function (a deferred import is still a cycle, only one that shows later); imports under
``if TYPE_CHECKING:`` are left out, since they never run. ``from package import name`` points at
``package.name`` when that is a module, else at the package. A package's ``__init__`` running first
is not counted as an edge. ``python eagle3_pipeline_tests/test_import_cycles.py`` prints the cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle3_pipeline"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            assert isinstance(node, ast.If)
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module → the package's modules it imports (module docstring)."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    top = root.name
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the importing module's package, up level - 1
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            graph[name] |= {t for t in targets if t.split(".")[0] == top and t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100, "the graph came out (nearly) empty"
    assert cycles(graph) == []


def test_the_check_finds_a_deferred_import_cycle(tmp_path: Path) -> None:
    """Two modules that import each other, one of them inside a function, make one cycle."""
    package = tmp_path / "eagle3_pipeline"
    (package / "drafter").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "drafter" / "__init__.py").write_text("")
    (package / "drafter" / "export.py").write_text("from eagle3_pipeline.drafter import speculators\n")
    (package / "drafter" / "speculators.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import eagle3_pipeline.drafter.formats\n"
        "def f():\n    from eagle3_pipeline.drafter.export import NAME\n"
    )
    (package / "drafter" / "formats.py").write_text("import eagle3_pipeline.drafter.speculators\n")
    assert cycles(import_graph(package)) == [["eagle3_pipeline.drafter.export", "eagle3_pipeline.drafter.speculators"]]


if __name__ == "__main__":
    for cycle in cycles(import_graph()):
        print(" <-> ".join(cycle))
