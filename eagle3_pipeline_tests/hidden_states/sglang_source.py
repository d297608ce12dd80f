"""Checks a release's SGLang entry points (``Release.uses`` and ``Release.aux`` of
:mod:`eagle3_pipeline.hidden_states.sglang_api`) against SGLang source read as text (``ast``,
nothing is imported): a wheel's (``test_sglang_signatures``) and the stand-in's (``test_sglang_backend``).

Per entry:

- ``Class.member``: the member is a method, a class-body field (dataclass or msgspec field, enum
  member) or an attribute some method assigns on ``self``, in the class or in a base class that its
  module imports (followed across modules);
- a class's keywords must be parameters of its ``__init__``, or fields of a record (dataclass,
  ``msgspec.Struct``, or a struct assembled by ``collect_input_fields`` from namespace classes, as
  0.5.23's ``ServerArgs``); a method's or function's keywords its parameters (or it takes
  ``**kwargs``), and it must take ``positional`` arguments;
- every **required** parameter (no default; keyword-only ones included) or record field must be
  passed, except for an entry the worker only reads (``reads``); a class listed without keywords is
  only referenced (``SGLangApi.cls``), not constructed;
- an attribute of a record that resolves lazily (a ``resolve_once`` method: its fields keep the raw
  input) is refused: the resolved value is read from the runtime context.

Across the entries (:func:`check_release`):

- a constructor or method whose body calls a guard (``assert_published``) needs the entry that
  satisfies it (``publish``);
- the entries together must reach ``init_distributed_environment`` (through ``self.`` methods and
  functions of the same module), or nothing builds SGLang's process groups;
- each :class:`AuxForm`: the decoder's ``forward`` collects ``aux_hidden_states`` in a list
  (``[]``, ``AuxHiddenStateList()``) or packs them (``AuxHiddenStatePacker(...)``), as declared.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from eagle3_pipeline.hidden_states.sglang_api import AuxForm, Release, SGLangUse

Reader = Callable[[str], str | None]  # a module's path in the tree ("sglang/srt/x.py") → its text, or None

# A guard an entry point calls → the entry (by name) the worker must use before it.
GUARDS = {"assert_published": "publish"}
PROCESS_GROUPS = "init_distributed_environment"
LAZY_RECORD = "resolve_once"
AUX_COLLECTORS = {"AuxHiddenStatePacker": "packed", "AuxHiddenStateList": "list"}


@dataclass(frozen=True)
class Found:
    module: str
    node: ast.ClassDef


def _decorators(node: ast.FunctionDef | ast.ClassDef) -> set[str]:
    names = set()
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def _base_names(node: ast.ClassDef) -> set[str]:
    return {base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "") for base in node.bases}


class SourceTree:
    """``paths``: the tree's files, where it can list them (a wheel)."""

    def __init__(self, read: Reader, paths: Iterable[str] = ()) -> None:
        self._read = read
        self.paths = tuple(paths)
        self._parsed: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._parsed:
            base = dotted.replace(".", "/")
            text = self._read(f"{base}.py")
            if text is None:
                text = self._read(f"{base}/__init__.py")
            self._parsed[dotted] = ast.parse(text) if text is not None else None
        return self._parsed[dotted]

    def _imported(self, dotted: str, tree: ast.Module, name: str) -> str | None:
        """The module ``name`` is imported from at the top of module ``dotted``."""
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and any((alias.asname or alias.name) == name for alias in node.names):
                if node.level:
                    package = dotted.split(".")[: -node.level]
                    return ".".join(package + ([node.module] if node.module else []))
                return node.module
        return None

    def find_class(self, dotted: str, name: str, depth: int = 0) -> Found | None:
        tree = self.module(dotted)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return Found(dotted, node)
        source = self._imported(dotted, tree, name)
        return self.find_class(source, name, depth + 1) if source else None

    def find_function(self, dotted: str, name: str) -> ast.FunctionDef | None:
        tree = self.module(dotted)
        if tree is None:
            return None
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        return None

    def bases(self, found: Found) -> list[Found]:
        result = []
        for base in found.node.bases:
            if isinstance(base, ast.Name):
                located = self.find_class(found.module, base.id)
                if located is not None:
                    result.append(located)
        return result

    def lineage(self, found: Found) -> list[Found]:
        """The class, then its bases (depth first), each once."""
        order, todo, seen = [], [found], set()
        while todo:
            current = todo.pop(0)
            key = (current.module, current.node.name)
            if key in seen:
                continue
            seen.add(key)
            order.append(current)
            todo.extend(self.bases(current))
        return order

    def assembled_fields(self, dotted: str) -> dict[str, bool] | None:
        """Fields of a record a module assembles with ``collect_input_fields(NAMESPACES)`` (0.5.23's
        ``ServerArgs``): name → required, from the namespace classes listed in ``NAMESPACES``."""
        tree = self.module(dotted)
        if tree is None:
            return None
        lists = {
            target.id: node.value
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "collect_input_fields"
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in lists
            ):
                fields: dict[str, bool] = {}
                for element in lists[node.args[0].id].elts:
                    found = self.find_class(dotted, element.id) if isinstance(element, ast.Name) else None
                    if found is not None:
                        fields.update(_record_fields(found.node))
                return fields
        return None


def _self_assignments(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (
                    isinstance(element, ast.Attribute)
                    and isinstance(element.value, ast.Name)
                    and element.value.id == "self"
                ):
                    names.add(element.attr)
    return names


def _body_names(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _record_fields(cls: ast.ClassDef) -> dict[str, bool]:
    """A record class's annotated fields → required (no default). ``ClassVar`` and private names are
    not fields."""
    fields = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id.startswith("_") or "ClassVar" in ast.unparse(node.annotation):
                continue
            fields[node.target.id] = node.value is None
    return fields


def _is_record(cls: ast.ClassDef) -> bool:
    return "dataclass" in _decorators(cls) or "Struct" in _base_names(cls)


def _module_names(module: ast.Module) -> set[str]:
    """Names a module binds at its top level (assignments, functions and imports, inside try/if too)."""
    names: set[str] = set()
    todo: list[ast.stmt] = list(module.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Try, ast.If)):
            todo.extend(
                [
                    *node.body,
                    *node.orelse,
                    *getattr(node, "finalbody", []),
                    *(s for h in getattr(node, "handlers", []) for s in h.body),
                ]
            )
    return names


def _method(lineage: list[Found], name: str) -> tuple[Found, ast.FunctionDef] | None:
    for found in lineage:
        for node in found.node.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return found, node  # type: ignore[return-value]
    return None


def _accepts(function: ast.FunctionDef, use: SGLangUse, implicit: int) -> list[str]:
    args = function.args
    if "staticmethod" in _decorators(function):
        implicit = 0
    posonly, regular = [a.arg for a in args.posonlyargs], [a.arg for a in args.args]
    ordered = (posonly + regular)[implicit:]
    named = set(regular[max(0, implicit - len(posonly)) :]) | {a.arg for a in args.kwonlyargs}
    problems = []
    missing = [k for k in use.keywords if k not in named]
    if missing and args.kwarg is None:
        problems.append(f"no parameter(s) {missing} (it has {ordered + [a.arg for a in args.kwonlyargs]})")
    if use.positional > len(ordered) and args.vararg is None:
        problems.append(f"takes {len(ordered)} positional argument(s), the worker passes {use.positional}")
    if use.reads:
        return problems
    positional_defaults = len(args.defaults)
    required = ordered[: len(ordered) - positional_defaults] if positional_defaults else ordered
    unpassed = [name for name in required[use.positional :] if name not in use.keywords]
    if unpassed:
        problems.append(f"required parameter(s) {unpassed} not passed")
    kwonly_required = [
        a.arg
        for a, default in zip(args.kwonlyargs, args.kw_defaults, strict=True)
        if default is None and a.arg not in use.keywords
    ]
    if kwonly_required:
        problems.append(f"required keyword-only parameter(s) {kwonly_required} not passed")
    return problems


def _record_problems(where: str, fields: dict[str, bool], use: SGLangUse) -> list[str]:
    missing = [k for k in use.keywords if k not in fields]
    unpassed = [name for name, required in fields.items() if required and name not in use.keywords]
    return [f"{where}: no field(s) {missing}"] * bool(missing) + [
        f"{where}(): required field(s) {unpassed} not passed"
    ] * bool(unpassed)


def check_use(tree: SourceTree, use: SGLangUse) -> list[str]:
    """What is wrong with ``use`` in ``tree`` on its own (empty: it is there as the worker uses it)."""
    where = f"{use.module}.{use.name}"
    module = tree.module(use.module)
    if module is None:
        return [f"{where}: no module {use.module}"]
    owner, _, member = use.name.partition(".")
    if not member:
        if use.kind == "attribute":
            return [] if owner in _module_names(module) else [f"{where}: no module-level {owner}"]
        if use.kind == "function":
            function = tree.find_function(use.module, owner)
            if function is None:
                return [f"{where}: no module-level function {owner}"]
            return [f"{where}(): {p}" for p in _accepts(function, use, 0)]
        cls = tree.find_class(use.module, owner)
        if cls is None:
            return [f"{where}: no class {owner}"]
        if not use.keywords:
            return []  # referenced (api.cls), not constructed
        lineage = tree.lineage(cls)
        init = _method(lineage, "__init__")
        if init is not None:
            return [f"{where}(): {p}" for p in _accepts(init[1], use, 1)]
        if any(_is_record(f.node) for f in lineage):
            fields: dict[str, bool] = {}
            for found in reversed(lineage):
                fields.update(_record_fields(found.node))
            return _record_problems(where, fields, use)
        assembled = tree.assembled_fields(cls.module)
        if assembled is not None:
            return _record_problems(where, assembled, use)
        return [f"{where}(): cannot tell its parameters (no __init__, not a record)"]
    cls = tree.find_class(use.module, owner)
    if cls is None:
        return [f"{where}: no class {owner}"]
    lineage = tree.lineage(cls)
    if use.kind == "method":
        found = _method(lineage, member)
        if found is None:
            return [f"{where}: no method {member} in {[f.node.name for f in lineage]}"]
        return [f"{where}(): {p}" for p in _accepts(found[1], use, 1)]
    if _method(lineage, LAZY_RECORD) is not None:
        return [
            f"{where}: {owner} resolves lazily ({LAZY_RECORD}); its fields keep the raw input: read the resolved "
            "value from the runtime context (get_schedule(), get_parallel(), get_device())"
        ]
    if any(
        member in _body_names(f.node) or member in _self_assignments(f.node) or _method(lineage, member)
        for f in lineage
    ):
        return []
    return [f"{where}: no attribute {member} in {[f.node.name for f in lineage]}"]


def _body(tree: SourceTree, use: SGLangUse) -> tuple[str, ast.FunctionDef, Found | None] | None:
    """The function a use runs first (a class's ``__init__``, a method, a function) with its module
    and class."""
    owner, _, member = use.name.partition(".")
    if use.kind == "function":
        function = tree.find_function(use.module, owner)
        return (use.module, function, None) if function is not None else None
    if use.kind not in ("class", "method") or use.reads:
        return None
    cls = tree.find_class(use.module, owner)
    if cls is None:
        return None
    found = _method(tree.lineage(cls), member or "__init__")
    return (found[0].module, found[1], cls) if found is not None else None


def _called_names(function: ast.FunctionDef) -> Iterable[tuple[str, bool]]:
    """(name, through self) of each call in ``function``: ``f(...)``, ``x.f(...)``, ``self.f(...)``."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                yield node.func.id, False
            elif isinstance(node.func, ast.Attribute):
                through_self = isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                yield node.func.attr, through_self


def _reaches(tree: SourceTree, start: tuple[str, ast.FunctionDef, Found | None], target: str, depth: int = 6) -> bool:
    """Whether ``start`` calls ``target``, directly or through ``self.`` methods of its class and
    functions of the modules it runs in."""
    todo, seen = [(start, 0)], set()
    while todo:
        (module, function, cls), level = todo.pop()
        key = (module, function.name, function.lineno)
        if key in seen or level > depth:
            continue
        seen.add(key)
        for name, through_self in _called_names(function):
            if name == target:
                return True
            if through_self and cls is not None:
                found = _method(tree.lineage(cls), name)
                if found is not None:
                    todo.append(((found[0].module, found[1], cls), level + 1))
            elif not through_self:
                local = tree.find_function(module, name)
                if local is not None:
                    todo.append(((module, local, None), level + 1))
    return False


def aux_form_found(tree: SourceTree, entry: AuxForm) -> str | None:
    """``list`` or ``packed``: how the decoder's ``forward`` collects ``aux_hidden_states``."""
    cls = tree.find_class(entry.module, entry.decoder)
    forward = _method(tree.lineage(cls), "forward") if cls is not None else None
    if forward is None:
        return None
    for node in ast.walk(forward[1]):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "aux_hidden_states" for t in node.targets)
            and node.value is not None
        ):
            value = node.value
            if isinstance(value, ast.List):
                return "list"
            if isinstance(value, ast.Call):
                name = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
                if name in AUX_COLLECTORS:
                    return AUX_COLLECTORS[name]
    return None


def check_aux(tree: SourceTree, entry: AuxForm) -> list[str]:
    found = aux_form_found(tree, entry)
    where = f"{entry.module}.{entry.decoder}.forward"
    if found is None:
        return [f"{where}: cannot tell how it collects aux_hidden_states"]
    if found != entry.form:
        shapes = {"list": "a list of K [N, H] tensors", "packed": "one packed [N, K*H] tensor"}
        return [f"{where} hands the LogitsProcessor {shapes[found]}; the release's AuxForm says {shapes[entry.form]}"]
    return []


def check_uses(tree: SourceTree, uses: Iterable[SGLangUse], aux: Iterable[AuxForm] = ()) -> list[str]:
    """Every problem of the entries: each on its own, the guards, the process groups, the aux forms."""
    uses = tuple(uses)
    problems = [problem for use in uses for problem in check_use(tree, use)]
    names = {use.name for use in uses}
    bodies = [(use, body) for use in uses if (body := _body(tree, use)) is not None]
    for use, (_, function, _) in bodies:
        for name, _ in _called_names(function):
            if name in GUARDS and GUARDS[name] not in names:
                problems.append(
                    f"{use.module}.{use.name} calls {name}(...): the worker must call {GUARDS[name]} first, and its "
                    f"uses have no {GUARDS[name]}"
                )
    if bodies and not any(_reaches(tree, body, PROCESS_GROUPS) for _, body in bodies):
        problems.append(
            f"no entry the worker calls reaches {PROCESS_GROUPS}: nothing builds SGLang's process groups "
            "(0.5.14's ModelRunner did; 0.5.23's distributed.bootstrap.init_parallel_runtime does)"
        )
    problems += [problem for entry in aux for problem in check_aux(tree, entry)]
    return problems


def check_release(tree: SourceTree, release: Release) -> list[str]:
    return check_uses(tree, release.uses, release.aux)


# --- the layer-id rule of a model class (set_eagle3_layers_to_capture) --------------------------------

FIRST_ID_1, EVERY_ID = "id + 1 only when the first id is 1", "id + 1 for every id"


@dataclass(frozen=True)
class LayerRule:
    rule: str | None  # FIRST_ID_1, EVERY_ID, or None (no EAGLE-3 switch, or one read differently)
    where: str  # module:line of the function that applies it


def _applies(function: ast.FunctionDef) -> str | None:
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Subscript)
            and ast.unparse(node.left) == "layer_ids[0]"
            and isinstance(node.ops[0], ast.Eq)
            and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value == 1
        ):
            return FIRST_ID_1
    for node in ast.walk(function):
        if (
            isinstance(node, ast.ListComp)
            and ast.unparse(node.generators[0].iter) == "layer_ids"
            and isinstance(node.elt, ast.BinOp)
            and isinstance(node.elt.op, ast.Add)
            and ast.unparse(node.elt.right) == "1"
        ):
            return EVERY_ID
    return None


def layer_rule(tree: SourceTree, module: str, name: str, depth: int = 0) -> LayerRule:
    """How class ``name`` of ``module`` turns a drafter's ids into ``layers_to_capture``: its own
    (or inherited) ``set_eagle3_layers_to_capture``, or the class it forwards the call to
    (``self.language_model.set_eagle3_layers_to_capture(layer_ids)``, that attribute's class)."""
    cls = tree.find_class(module, name)
    found = _method(tree.lineage(cls), "set_eagle3_layers_to_capture") if cls is not None else None
    if cls is None or found is None or depth > 4:
        return LayerRule(None, f"{module}:{name}")
    owner, function = found
    where = f"{owner.module.replace('.', '/')}.py:{function.lineno}"
    applied = _applies(function)
    if applied is not None:
        return LayerRule(applied, where)
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "set_eagle3_layers_to_capture"
            and isinstance(node.func.value, ast.Attribute)
            and ast.unparse(node.func.value.value) == "self"
        ):
            attribute = node.func.value.attr
            for assign in ast.walk(owner.node):
                if (
                    isinstance(assign, ast.Assign)
                    and any(ast.unparse(t) == f"self.{attribute}" for t in assign.targets)
                    and isinstance(assign.value, ast.Call)
                    and isinstance(assign.value.func, ast.Name)
                ):
                    target = tree.find_class(owner.module, assign.value.func.id)
                    if target is not None:
                        inner = layer_rule(tree, target.module, target.node.name, depth + 1)
                        return LayerRule(inner.rule, f"{where} -> {inner.where}")
    return LayerRule(None, where)


def entry_classes(tree: SourceTree) -> list[tuple[str, str]]:
    """(module, class) of every model class SGLang registers (``EntryClass`` of ``sglang/srt/models/*.py``)."""
    found = []
    for path in tree.paths:
        if not (path.startswith("sglang/srt/models/") and path.endswith(".py") and path.count("/") == 3):
            continue
        module = path[: -len(".py")].replace("/", ".")
        try:
            parsed = tree.module(module)
        except SyntaxError:
            continue
        for node in parsed.body if parsed is not None else []:
            if isinstance(node, ast.Assign) and any(ast.unparse(t) == "EntryClass" for t in node.targets):
                values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                found += [(module, value.id) for value in values if isinstance(value, ast.Name)]
    return found
