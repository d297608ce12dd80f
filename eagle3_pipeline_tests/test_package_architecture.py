"""The package's shape: no import cycle between modules or between packages, and no upward import.

The graph is read from the source with ``ast`` (nothing is imported): an edge for every ``import``
and ``from … import`` (absolute or relative) of a module of ``eagle3_pipeline``, at module level or
inside a function (a deferred import is still a dependency, only one that shows later); imports under
``if TYPE_CHECKING:`` are left out, since they never run. ``from package import name`` points at
``package.name`` when that is a module, else at the package. A package's ``__init__`` running first
is not counted as an edge.

The layers (:data:`LAYERS`, lowest first) follow docs/design.md "Layers": the pipeline file's models,
then plain records, then the domain from the machinery under the phases up to the drafter, then the
Dagster layer, then the entry points. A package imports only its own layer and those below; only the
Dagster layer and the entry points import Dagster. ``python eagle3_pipeline_tests/test_package_architecture.py``
prints the rules, the cycles and the upward imports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle3_pipeline"
TOP = PACKAGE.name

# (name, the packages and top-level modules of eagle3_pipeline in it), lowest first.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("config: the pipeline file as validated models", ("config",)),
    ("records: plain records and leaf adapters", ("records", "results", "layout", "target", "hosts")),
    ("machinery: health probes, where a heavy phase runs", ("health", "compute")),
    ("generation: prompts and the target's responses", ("generation",)),
    ("servers: the health gate and alerts, managed servers, serving", ("watch", "managed", "serving")),
    ("training data", ("dataprep",)),
    ("hidden states and the draft vocabulary", ("hidden_states",)),
    ("drafter", ("drafter",)),
    ("tools over the domain: the status and schedule views, the tests' stand-ins", ("overview", "testing", "fit")),
    ("worker: a heavy phase's entry point on a GPU host (dagster-pipes only)", ("worker",)),
    ("Dagster layer: orchestration policy and the definitions", ("orchestration", "components")),
    ("entry points", ("cli", "definitions")),
)
DAGSTER_LAYERS = frozenset({"Dagster layer: orchestration policy and the definitions", "entry points"})
# Modules below the Dagster layer may use Pipes' own small library, not Dagster.
DAGSTER_ALLOWED_BELOW = frozenset({"dagster_pipes"})


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


def _targets(node: ast.Import | ast.ImportFrom, name: str, path: Path, modules: Iterable[str]) -> list[str]:
    """The absolute module names one import statement of module ``name`` (at ``path``) reaches."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package, up level - 1
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
    known = set(modules)
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module → the package's modules it imports (module docstring)."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    top = root.name
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets = _targets(node, name, path, modules)
            graph[name] |= {t for t in targets if t.split(".")[0] == top and t in modules and t != name}
    return graph


def outside_imports(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module → the top-level names of the other distributions it imports (``dagster``, ``torch``, …)."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    found: dict[str, set[str]] = {}
    for name, path in modules.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                continue
            for target in _targets(node, name, path, modules):
                if target.split(".")[0] != root.name:
                    found.setdefault(name, set()).add(target.split(".")[0])
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
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


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles between sibling packages (and modules) at every level: under each package, its children
    as nodes, an edge where a module of one imports a module of another."""
    packages = {name for name in graph if any(other.startswith(name + ".") for other in graph)}
    found = []
    for parent in sorted(packages):

        def child(module: str, parent: str = parent) -> str:
            return parent + "." + module[len(parent) + 1 :].split(".")[0]

        siblings: dict[str, set[str]] = {}
        for module, imported in graph.items():
            if module.startswith(parent + "."):
                edges = siblings.setdefault(child(module), set())
                for target in imported:
                    if target.startswith(parent + "."):
                        edges.add(child(target))
        for node, edges in siblings.items():
            edges.discard(node)
            for target in edges:
                siblings.setdefault(target, set())
        found.extend(cycles(siblings))
    return found


def layer_of(module: str, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> int:
    """The index in ``layers`` of a module's top-level package (the package itself for ``eagle3_pipeline``)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    if not top:
        return -1
    for index, (_, members) in enumerate(layers):
        if top in members:
            return index
    raise AssertionError(f"{module}: package {top!r} is in no layer; add it to LAYERS in {Path(__file__).name}")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported (layer → higher layer)`` for every import of a higher layer."""
    found = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            here, there = layer_of(module), layer_of(target)
            if 0 <= here < there:
                found.append(f"{module} -> {target} ({LAYERS[here][0]} → {LAYERS[there][0]})")
    return found


def dagster_below_its_layer(outside: dict[str, set[str]]) -> list[str]:
    found = []
    for module, names in sorted(outside.items()):
        index = layer_of(module)
        if index < 0 or LAYERS[index][0] in DAGSTER_LAYERS:
            continue
        for name in sorted(names):
            if name.startswith("dagster") and name not in DAGSTER_ALLOWED_BELOW:
                found.append(f"{module} imports {name} ({LAYERS[index][0]})")
    return found


def rules() -> str:
    """What the tests forbid, as they print it."""
    lines = ["Layers, lowest first; a package imports only its own layer and those below:"]
    lines += [f"  {i}. {name}: {', '.join(members)}" for i, (name, members) in enumerate(LAYERS)]
    lines += [
        "Forbidden: an import of a higher layer (at module level or inside a function); an import cycle",
        "between modules, or between sibling packages at any level; dagster below the Dagster layer",
        f"(only {', '.join(sorted(DAGSTER_ALLOWED_BELOW))} there).",
    ]
    return "\n".join(lines)


def test_the_package_has_no_import_cycle_between_modules() -> None:
    graph = import_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100, "the graph came out (nearly) empty"
    assert cycles(graph) == [], rules()


def test_no_package_imports_a_package_that_imports_it_back() -> None:
    print(rules())
    assert package_cycles(import_graph()) == [], rules()


def test_no_package_imports_a_higher_layer() -> None:
    assert upward_imports(import_graph()) == [], rules()


def test_only_the_dagster_layer_imports_dagster() -> None:
    outside = outside_imports()
    assert any("dagster" in names for names in outside.values()), "found no dagster import at all"
    assert dagster_below_its_layer(outside) == [], rules()


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "eagle3_pipeline"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in [path.parent, *path.parent.parents]:
            if folder == package.parent:
                break
            (folder / "__init__.py").touch()
        path.write_text(text)
    return package


def test_the_check_finds_a_deferred_import_cycle(tmp_path: Path) -> None:
    """Two modules that import each other, one of them inside a function, make one cycle."""
    package = _tree(
        tmp_path,
        {
            "drafter/export.py": "from eagle3_pipeline.drafter import speculators\n",
            "drafter/speculators.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    import eagle3_pipeline.drafter.formats\n"
            "def f():\n    from eagle3_pipeline.drafter.export import NAME\n",
            "drafter/formats.py": "import eagle3_pipeline.drafter.speculators\n",
        },
    )
    assert cycles(import_graph(package)) == [["eagle3_pipeline.drafter.export", "eagle3_pipeline.drafter.speculators"]]


def test_the_checks_find_a_package_cycle_an_upward_import_and_dagster_in_the_domain(tmp_path: Path) -> None:
    """dataprep → hidden_states → dataprep through different modules (no module cycle) is a package
    cycle; config importing the domain, and the domain importing dagster or the Dagster layer, are
    upward; dagster_pipes in the worker is not."""
    package = _tree(
        tmp_path,
        {
            "dataprep/phase.py": "def f():\n    from eagle3_pipeline.hidden_states import validation\n",
            "dataprep/agreement.py": "X = 1\n",
            "hidden_states/validation.py": "from eagle3_pipeline.dataprep.agreement import X\n",
            "config/loader.py": "from eagle3_pipeline.drafter import train\n",
            "drafter/train.py": "import dagster as dg\nfrom eagle3_pipeline.components import pipeline\n",
            "components/pipeline.py": "import dagster\n",
            "worker.py": "from dagster_pipes import open_dagster_pipes\n",
        },
    )
    graph = import_graph(package)
    assert cycles(graph) == []
    assert package_cycles(graph) == [["eagle3_pipeline.dataprep", "eagle3_pipeline.hidden_states"]]
    assert [line.split(" (")[0] for line in upward_imports(graph)] == [
        "eagle3_pipeline.config.loader -> eagle3_pipeline.drafter.train",
        "eagle3_pipeline.dataprep.phase -> eagle3_pipeline.hidden_states.validation",
        "eagle3_pipeline.drafter.train -> eagle3_pipeline.components.pipeline",
    ]
    assert [line.split(" (")[0] for line in dagster_below_its_layer(outside_imports(package))] == [
        "eagle3_pipeline.drafter.train imports dagster"
    ]


if __name__ == "__main__":
    graph = import_graph()
    print(rules())
    for cycle in cycles(graph) + package_cycles(graph):
        print("cycle:", " <-> ".join(cycle))
    for line in upward_imports(graph) + dagster_below_its_layer(outside_imports()):
        print("upward:", line)
