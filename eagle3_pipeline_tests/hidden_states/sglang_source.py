"""Checks the entries of ``SGLANG_USES`` against SGLang source read as text (``ast``, nothing is
imported): the pinned wheel's (``test_sglang_signatures``) and the stand-in's (``test_sglang_backend``).

For an entry ``Class.member`` the member is a method, a class-body field (dataclass field, enum
member) or an attribute some method assigns on ``self``, in the class or in a base class that its
module imports (followed across modules). A class's keywords must be parameters of its
``__init__`` (or fields of a dataclass); a method's keywords its parameters (or it takes
``**kwargs``), and it must take ``positional`` arguments after ``self``/``cls``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

from eagle3_pipeline.hidden_states.sglang_capture import SGLangUse

Reader = Callable[[str], str | None]  # a module's path in the tree ("sglang/srt/x.py") → its text, or None


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


class SourceTree:
    def __init__(self, read: Reader) -> None:
        self._read = read
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


def _module_names(module: ast.Module) -> set[str]:
    """Names a module binds at its top level (assignments and imports, inside try/if blocks too)."""
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


def _method(lineage: list[Found], name: str) -> ast.FunctionDef | None:
    for found in lineage:
        for node in found.node.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node  # type: ignore[return-value]
    return None


def _accepts(function: ast.FunctionDef, keywords: tuple[str, ...], positional: int) -> list[str]:
    args = function.args
    implicit = 0 if "staticmethod" in _decorators(function) else 1
    posonly, regular = [a.arg for a in args.posonlyargs], [a.arg for a in args.args]
    ordered = (posonly + regular)[implicit:]
    named = set(regular[max(0, implicit - len(posonly)) :]) | {a.arg for a in args.kwonlyargs}
    problems = []
    missing = [k for k in keywords if k not in named]
    if missing and args.kwarg is None:
        problems.append(f"no parameter(s) {missing} (it has {ordered + [a.arg for a in args.kwonlyargs]})")
    if positional > len(ordered) and args.vararg is None:
        problems.append(f"takes {len(ordered)} positional argument(s), the worker passes {positional}")
    return problems


def check_use(tree: SourceTree, use: SGLangUse) -> list[str]:
    """What is wrong with ``use`` in ``tree`` (empty: it is there as the worker uses it)."""
    where = f"{use.module}.{use.name}"
    module = tree.module(use.module)
    if module is None:
        return [f"{where}: no module {use.module}"]
    owner, _, member = use.name.partition(".")
    if not member:
        if use.kind == "attribute":
            return [] if owner in _module_names(module) else [f"{where}: no module-level {owner}"]
        cls = tree.find_class(use.module, owner)
        if cls is None:
            return [f"{where}: no class {owner}"]
        if not use.keywords:
            return []
        lineage = tree.lineage(cls)
        init = _method(lineage, "__init__")
        if init is not None:
            return [f"{where}(): {p}" for p in _accepts(init, use.keywords, 0)]
        fields = set().union(*(_body_names(f.node) for f in lineage if "dataclass" in _decorators(f.node)))
        missing = [k for k in use.keywords if k not in fields]
        return [f"{where}: no field(s) {missing}"] if missing else []
    cls = tree.find_class(use.module, owner)
    if cls is None:
        return [f"{where}: no class {owner}"]
    lineage = tree.lineage(cls)
    if use.kind == "method":
        function = _method(lineage, member)
        if function is None:
            return [f"{where}: no method {member} in {[f.node.name for f in lineage]}"]
        return [f"{where}(): {p}" for p in _accepts(function, use.keywords, use.positional)]
    if any(
        member in _body_names(f.node) or member in _self_assignments(f.node) or _method(lineage, member)
        for f in lineage
    ):
        return []
    return [f"{where}: no attribute {member} in {[f.node.name for f in lineage]}"]


def check_uses(tree: SourceTree, uses: tuple[SGLangUse, ...]) -> list[str]:
    return [problem for use in uses for problem in check_use(tree, use)]
