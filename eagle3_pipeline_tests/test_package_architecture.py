"""The package's shape: no import cycle between modules or between packages, and none of the forbidden
dependencies, a short map of the design's rules (SpecForge keeps one the same way) rather than a total order
of layers.

The graph is read from the source with ``ast`` (nothing is imported): an edge for every ``import``
and ``from … import`` (absolute or relative) of a module of ``eagle3_pipeline``, at module level or
inside a function (a deferred import is still a dependency, only one that shows later); imports under
``if TYPE_CHECKING:`` are left out, since they never run. ``from package import name`` points at
``package.name`` when that is a module, else at the package. A package's ``__init__`` running first
is not counted as an edge.

:data:`FORBIDDEN` says, per rule, which top-level packages must not import which (docs/design.md
"Layers"); :data:`EXCEPTIONS` lists the edges allowed anyway, with the reason, and is compared for equality
with what the rules find, so an exception that no longer exists fails too. Only :data:`DAGSTER_PACKAGES`
import Dagster. Inside ``drafter/``, :data:`DRAFTER_ORDER` says which part may import which.
``python eagle3_pipeline_tests/test_package_architecture.py`` prints the rules, the cycles
and the forbidden edges it finds.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle3_pipeline"
TOP = PACKAGE.name

# The Dagster layer (the definitions and the orchestration policy) and the entry points.
DAGSTER_PACKAGES = frozenset({"components", "orchestration", "cli", "definitions"})
# Modules outside them may use Pipes' own small library, not Dagster.
DAGSTER_ALLOWED_BELOW = frozenset({"dagster_pipes"})
# The phases in pipeline order: a phase never imports a later one.
PHASES = ("generation", "training_data", "hidden_states", "drafter")


@dataclass(frozen=True)
class AllBut:
    """Every top-level package of eagle3_pipeline but ``excluded``."""

    excluded: frozenset[str] = frozenset()


Packages = frozenset[str] | AllBut

# (rule, importers, the packages they must not import).
FORBIDDEN: tuple[tuple[str, Packages, Packages], ...] = (
    (
        "the pipeline file's models, plain records and leaf adapters import nothing of the package",
        frozenset({"config", "records", "results", "layout", "target", "hosts"}),
        AllBut(),
    ),
    (
        "health probes and where a heavy phase runs know nothing of servers, phases or views",
        frozenset({"health", "compute"}),
        frozenset({"managed", "inference", *PHASES, "fit"}),
    ),
    *(
        (f"a phase never imports a later one ({phase})", frozenset({phase}), frozenset(PHASES[i + 1 :]))
        for i, phase in enumerate(PHASES[:-1])
    ),
    (
        "the domain knows nothing of the Dagster layer, the entry points or the views over it",
        frozenset({"health", "compute", "managed", "inference", *PHASES, "worker", "testing"}),
        frozenset({*DAGSTER_PACKAGES, "fit"}),
    ),
    (
        "the tests' stand-ins are never imported by the product",
        AllBut(frozenset({"testing"})),
        frozenset({"testing"}),
    ),
    (
        "the worker runs on a GPU host with dagster-pipes only: it imports where a heavy phase runs, nothing else",
        frozenset({"worker"}),
        AllBut(frozenset({"compute"})),
    ),
    (
        "the Dagster layer is imported only by the entry points",
        AllBut(frozenset({"cli", "definitions"})),
        frozenset({"components"}),
    ),
    ("nothing imports the entry points", AllBut(), frozenset({"cli", "definitions"})),
)
# (importer module, imported module) -> why the edge is allowed though a rule forbids it. Compared for equality.
EXCEPTIONS: dict[tuple[str, str], str] = {}


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


def top_package(module: str) -> str:
    """The top-level package (or module) of ``eagle3_pipeline`` a module belongs to; ``""`` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def forbidden_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], str]:
    """``(importer, imported) -> rule`` for every import a rule of :data:`FORBIDDEN` forbids (between different
    top-level packages)."""
    packages = frozenset(top_package(m) for m in graph) - {""}
    found: dict[tuple[str, str], str] = {}
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            here, there = top_package(module), top_package(target)
            if not here or here == there:
                continue
            for rule, importers, forbidden in FORBIDDEN:
                if here in expand(importers, packages) and there in expand(forbidden, packages):
                    found.setdefault((module, target), rule)
    return found


def expand(names: Packages, packages: frozenset[str]) -> frozenset[str]:
    return packages - names.excluded if isinstance(names, AllBut) else names


def dagster_outside_its_layer(outside: dict[str, set[str]]) -> list[str]:
    found = []
    for module, names in sorted(outside.items()):
        if top_package(module) in DAGSTER_PACKAGES or not top_package(module):
            continue
        for name in sorted(names):
            if name.startswith("dagster") and name not in DAGSTER_ALLOWED_BELOW:
                found.append(f"{module} imports {name}")
    return found


def rules() -> str:
    """What the tests forbid, as they print it."""
    lines = ["Forbidden imports between the top-level packages of eagle3_pipeline:"]
    for rule, importers, forbidden in FORBIDDEN:
        lines.append(f"  {rule}: {_describe(importers)} must not import {_describe(forbidden)}")
    lines += [
        f"Exceptions allowed: {len(EXCEPTIONS)}.",
        "Forbidden too: an import cycle between modules, or between sibling packages at any level; dagster",
        f"outside {', '.join(sorted(DAGSTER_PACKAGES))} (only {', '.join(sorted(DAGSTER_ALLOWED_BELOW))} there).",
    ]
    return "\n".join(lines)


def _describe(names: Packages) -> str:
    if isinstance(names, AllBut):
        return "any package" + (f" but {', '.join(sorted(names.excluded))}" if names.excluded else "")
    return ", ".join(sorted(names))


def test_the_package_has_no_import_cycle_between_modules() -> None:
    graph = import_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100, "the graph came out (nearly) empty"
    assert cycles(graph) == [], rules()


def test_no_package_imports_a_package_that_imports_it_back() -> None:
    print(rules())
    assert package_cycles(import_graph()) == [], rules()


def test_the_forbidden_edges_found_are_exactly_the_listed_exceptions() -> None:
    found = forbidden_edges(import_graph())
    unexpected = {edge: rule for edge, rule in found.items() if edge not in EXCEPTIONS}
    stale = sorted(edge for edge in EXCEPTIONS if edge not in found)
    assert not unexpected, rules() + "\n" + "\n".join(f"{a} -> {b} ({rule})" for (a, b), rule in unexpected.items())
    assert not stale, f"EXCEPTIONS lists edges that no longer exist or no rule forbids (remove them): {stale}"


def test_every_package_is_named_by_the_rules() -> None:
    """A new top-level package is placed deliberately: some rule names it; and no rule names a package gone."""
    packages = frozenset(top_package(m) for m in import_graph()) - {""}
    named = {name for _, *sets in FORBIDDEN for names in sets if isinstance(names, frozenset) for name in names}
    assert not packages - named, f"packages no rule of FORBIDDEN names (place them): {sorted(packages - named)}"
    assert not named - packages, f"FORBIDDEN names packages that do not exist: {sorted(named - packages)}"


def test_only_the_dagster_layer_imports_dagster() -> None:
    outside = outside_imports()
    assert any("dagster" in names for names in outside.values()), "found no dagster import at all"
    assert dagster_outside_its_layer(outside) == [], rules()


# The drafter's parts in the order they may import one another (drafter/DESIGN.md): each imports only those
# before it; serve/ (the benchmark and the served drafter) imports spec.py alone.
DRAFTER_ORDER = ("spec", "model", "export", "evaluate", "train")


def drafter_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """``(part, part)`` for every import between two parts (subpackages, ``spec``) of ``drafter/``."""
    prefix = f"{TOP}.drafter."
    return {
        (module.split(".")[2], target.split(".")[2])
        for module, imported in graph.items()
        if module.startswith(prefix)
        for target in imported
        if target.startswith(prefix) and module.split(".")[2] != target.split(".")[2]
    }


def test_the_drafter_parts_import_only_the_parts_before_them() -> None:
    edges = drafter_edges(import_graph())
    assert ("train", "model") in edges, "found no import between the drafter's parts"
    order = {part: i for i, part in enumerate(DRAFTER_ORDER)}
    backward = sorted(
        (a, b) for a, b in edges if b != "spec" and (a not in order or order.get(b, len(order)) >= order[a])
    )
    assert not backward, f"drafter parts importing a later part or serve/ (order {DRAFTER_ORDER}): {backward}"


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 120
MAX_POSITIONAL = 6  # beyond it, parameters are keyword-only (or one small record)
# "path" or "path:function" -> why it may exceed a limit. Compared for equality with what the sizes find.
SIZE_EXCEPTIONS: dict[str, str] = {
    "eagle3_pipeline/testing/kimi/tokenization_kimi.py:__init__": "Kimi-K2.5's remote code, whose signature "
    "Hugging Face's loader calls",
    "eagle3_pipeline/testing/kimi/modeling_kimi_k25.py:forward": "Kimi-K2.5's remote code, whose signature "
    "Hugging Face's generate calls",
}


def oversized(root: Path = PACKAGE) -> dict[str, str]:
    """``path[:function]`` -> what exceeds :data:`MAX_MODULE_LINES`, :data:`MAX_FUNCTION_LINES` or
    :data:`MAX_POSITIONAL` (``self``/``cls`` not counted)."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        where = str(path.relative_to(root.parent))
        text = path.read_text()
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            found[where] = f"{lines} lines"
        for node in ast.walk(ast.parse(text, where)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            assert node.end_lineno is not None
            span = node.end_lineno - node.lineno + 1
            positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            problems = [f"{span} lines"] * (span > MAX_FUNCTION_LINES)
            problems += [f"{len(positional)} positional parameters"] * (len(positional) > MAX_POSITIONAL)
            if problems:
                found[f"{where}:{node.name}"] = ", ".join(problems)
    return found


def test_modules_functions_and_positional_parameters_stay_within_their_limits() -> None:
    found = oversized()
    unexpected = {where: what for where, what in found.items() if where not in SIZE_EXCEPTIONS}
    stale = sorted(where for where in SIZE_EXCEPTIONS if where not in found)
    assert not unexpected, (
        f"over {MAX_MODULE_LINES} lines a module, {MAX_FUNCTION_LINES} a function, or {MAX_POSITIONAL} positional "
        "parameters (split it; make the rest keyword-only): " + "; ".join(f"{w}: {x}" for w, x in unexpected.items())
    )
    assert not stale, f"SIZE_EXCEPTIONS lists what is now within the limits (remove it): {stale}"


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


def test_the_checks_find_a_package_cycle_forbidden_edges_and_dagster_in_the_domain(tmp_path: Path) -> None:
    """training_data → hidden_states → training_data through different modules (no module cycle) is a package
    cycle; config importing the domain, an earlier phase importing a later one, the domain importing
    dagster or the Dagster layer are forbidden; dagster_pipes in the worker is not."""
    package = _tree(
        tmp_path,
        {
            "training_data/phase.py": "def f():\n    from eagle3_pipeline.hidden_states import validation\n",
            "training_data/agreement.py": "X = 1\n",
            "hidden_states/validation.py": "from eagle3_pipeline.training_data.agreement import X\n",
            "config/loader.py": "from eagle3_pipeline.drafter import train\n",
            "drafter/train.py": "import dagster as dg\nfrom eagle3_pipeline.components import pipeline\n",
            "components/pipeline.py": "import dagster\n",
            "worker.py": "from dagster_pipes import open_dagster_pipes\n",
        },
    )
    graph = import_graph(package)
    assert cycles(graph) == []
    assert package_cycles(graph) == [["eagle3_pipeline.hidden_states", "eagle3_pipeline.training_data"]]
    assert forbidden_edges(graph) == {
        ("eagle3_pipeline.config.loader", "eagle3_pipeline.drafter.train"): FORBIDDEN[0][0],
        ("eagle3_pipeline.training_data.phase", "eagle3_pipeline.hidden_states.validation"): "a phase never imports a "
        "later one (training_data)",
        ("eagle3_pipeline.drafter.train", "eagle3_pipeline.components.pipeline"): "the domain knows nothing of the "
        "Dagster layer, the entry points or the views over it",
    }
    assert [line.split(" (")[0] for line in dagster_outside_its_layer(outside_imports(package))] == [
        "eagle3_pipeline.drafter.train imports dagster"
    ]


if __name__ == "__main__":
    graph = import_graph()
    print(rules())
    for cycle in cycles(graph) + package_cycles(graph):
        print("cycle:", " <-> ".join(cycle))
    for (importer, imported), rule in forbidden_edges(graph).items():
        print(
            f"forbidden: {importer} -> {imported} ({rule})"
            + (" [exception]" if (importer, imported) in EXCEPTIONS else "")
        )
    for line in dagster_outside_its_layer(outside_imports()):
        print("dagster:", line)
