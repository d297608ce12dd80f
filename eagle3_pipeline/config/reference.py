"""The settings reference (`docs/settings.md`), generated from the pipeline file's models.

It walks :class:`PipelineConfig`'s JSON schema section by section: one table per section (the
setting's path, its type and constraints, its default, its description), a nested section after
the section that holds it. Regenerate the checked-in file after changing a model::

    python -m eagle3_pipeline.config.reference docs/settings.md
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.pipeline import PipelineConfig

REGENERATE = "python -m eagle3_pipeline.config.reference docs/settings.md"
# Fields of the root model that are no setting: the loader fills them in and refuses them in a file.
NOT_SETTINGS = frozenset({"source_file"})
# Required by the model, but given a default by the loader when the file leaves them out.
LOADER_DEFAULTS = {
    "artifacts_root": "`$EAGLE3_ARTIFACTS_ROOT/<name>`, `~/.local/share/eagle3_pipeline/<name>` (shipped profiles) "
    "or `<file's folder>/artifacts/<name>`"
}

_BOUNDS = (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<"))


@dataclass
class _Section:
    path: str
    doc: str
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)


def _ref_name(node: dict[str, Any]) -> str | None:
    ref = node.get("$ref")
    return ref.rsplit("/", 1)[-1] if isinstance(ref, str) else None


def _code(text: str) -> str:
    return f"`{text}`"


def _type(node: dict[str, Any], sections: dict[str, str]) -> str:
    """A schema node as a reader types it in YAML, with its constraints."""
    name = _ref_name(node)
    if name is not None:
        return f"section {_code(sections[name])}" if name in sections else "section"
    if "anyOf" in node:
        return " or ".join(_type(option, sections) for option in node["anyOf"])
    if "const" in node:
        return _value(node["const"])
    if "enum" in node:
        return "one of " + ", ".join(_value(value) for value in node["enum"])
    kind = node.get("type")
    if kind == "array":
        text = f"list of {_type(node.get('items', {}), sections)}"
        if "minItems" in node:
            text += f" (at least {node['minItems']})"
        return text
    if kind == "object":
        keys, values = _mapping(node)
        key_text = _type({"type": "string", **keys}, sections)
        value_text = _type(values, sections) if isinstance(values, dict) else "any"
        text = f"mapping of {key_text} → {value_text}"
        if "minProperties" in node:
            text += f" (at least {node['minProperties']})"
        return text
    if kind == "null":
        return "null"
    words = {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean"}
    text = words.get(kind, "any") if isinstance(kind, str) else "any"
    if node.get("format") == "date-time":
        text = "date-time (ISO 8601 with a UTC offset)"
    elif node.get("format") == "path":
        text = "path"
    bounds = [f"{sign} {node[key]}" for key, sign in _BOUNDS if key in node]
    if "minLength" in node:
        bounds.append(f"length ≥ {node['minLength']}")
    if "pattern" in node:
        bounds.append(f"matching {_code(node['pattern'])}")
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _default(node: dict[str, Any], required: bool) -> str:
    if required:
        return "required"
    if "default" not in node or _ref_name(node) is not None or _model_in(node) is not None:
        return "—"
    return _value(node["default"])


def _value(value: Any) -> str:
    """A value as it is written in the YAML file."""
    if isinstance(value, str) and value:
        return _code(value)
    return _code(json.dumps(value, ensure_ascii=False))


def _mapping(node: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(key schema, value schema) of a mapping; a key pattern comes as patternProperties."""
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict) and len(patterns) == 1:
        ((pattern, values),) = patterns.items()
        return {"pattern": pattern}, values
    return node.get("propertyNames", {}), node.get("additionalProperties")


def _model_in(node: dict[str, Any]) -> str | None:
    """The model a field holds directly or as its optional value."""
    name = _ref_name(node)
    if name is not None:
        return name
    options = [option for option in node.get("anyOf", []) if option.get("type") != "null"]
    return _ref_name(options[0]) if len(options) == 1 else None


def _cell(text: str) -> str:
    """One table cell: one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _prose(text: str) -> str:
    """A description as Markdown: one line, ``<name>`` kept as text rather than read as an HTML tag."""
    return _cell(text).replace("<", "\\<")


def _nested(node: dict[str, Any]) -> tuple[str, str] | None:
    """(suffix, model) for a field holding a model: itself, optional, a list of them or a mapping to them."""
    name = _model_in(node)
    if name is not None:
        return "", name
    for option in [node, *node.get("anyOf", [])]:
        if option.get("type") == "array" and _ref_name(option.get("items", {})):
            return "[]", _ref_name(option["items"]) or ""
        values = _mapping(option)[1]
        if option.get("type") == "object" and isinstance(values, dict) and _ref_name(values):
            return ".<name>", _ref_name(values) or ""
    return None


def _walk(schema: dict[str, Any], model: dict[str, Any], path: str, out: list[_Section], seen: dict[str, str]) -> None:
    defs = schema.get("$defs", {})
    section = _Section(path, model.get("description", ""))
    out.append(section)
    required = set(model.get("required", []))
    later: list[tuple[str, str]] = []
    for name, node in model.get("properties", {}).items():
        if not path and name in NOT_SETTINGS:
            continue
        setting = f"{path}.{name}" if path else name
        nested = _nested(node)
        if nested is not None:
            suffix, model_name = nested
            if model_name not in seen:
                seen[model_name] = setting + suffix
                later.append((setting + suffix, model_name))
        kind = _type(node, seen)
        default = LOADER_DEFAULTS.get(name) if not path else None
        section.rows.append(
            (
                _code(setting),
                _cell(kind),
                default or _default(node, name in required),
                _prose(node.get("description", "")),
            )
        )
    for setting, model_name in later:
        _walk(schema, defs[model_name], setting, out, seen)


def sections() -> list[_Section]:
    """Every section of the pipeline file in file order, each followed by the sections it holds."""
    schema = PipelineConfig.model_json_schema()
    out: list[_Section] = []
    _walk(schema, schema, "", out, {})
    return out


def render() -> str:
    """The settings reference as Markdown."""
    lines = [
        "# Settings reference",
        "",
        "Every key of a pipeline file (YAML), section by section: its path, type and constraints, default and",
        "meaning. A key left out takes its default; an unknown key is refused. Generated from the models in",
        "`eagle3_pipeline/config/` by",
        "",
        f"    {REGENERATE}",
        "",
        "so edit the models' field descriptions, not this file (`eagle3_pipeline_tests/config/test_reference.py`",
        "checks that it is up to date).",
    ]
    for section in sections():
        title = f"`{section.path}`" if section.path else "Top level"
        level = "###" if "." in section.path else "##"
        lines += ["", f"{level} {title}", ""]
        if section.doc:
            lines += [_prose(section.doc), ""]
        lines += ["| setting | type | default | description |", "|---|---|---|---|"]
        lines += [f"| {' | '.join(row)} |" for row in section.rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the reference to the path given (or print it)."""
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if not args:
        sys.stdout.write(text)
        return 0
    Path(args[0]).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
