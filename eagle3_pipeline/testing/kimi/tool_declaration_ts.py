"""TypeScript-style tool declarations, as Kimi-K2.5's tokenizer writes them into the prompt.

Remote code of the tiny Kimi-K2.5 stand-in (copied next to ``tokenization_kimi.py`` in the
checkpoint folder and imported relatively, like the real checkpoint's ``tool_declaration_ts.py``).

Kimi-K2.5's ``apply_chat_template`` turns the OpenAI ``tools`` list into a TypeScript namespace
and hands it to the chat template as ``tools_ts_str``; the template puts it in the
``<|im_system|>tool_declare<|im_middle|>…<|im_end|>`` turn (compact JSON only when no
``tools_ts_str`` is given). This is an independent re-implementation of that layout for the JSON
Schema subset tool declarations use in practice:

* ``# Tools`` / ``## functions`` / ``namespace functions { … }``, one
  ``type NAME = (_: {…}) => any;`` per function, its description as ``//`` lines above it;
* object fields one per line, two spaces deeper per level, required fields first (sorted by
  name) then optional ones (``name?:``, sorted); ``[k: string]: T`` for ``additionalProperties``;
* ``integer`` → ``number``; enums as ``"a" | "b"``; ``anyOf`` and type lists as unions;
  ``Array<T>`` (multi-line when the item carries a description);
* a field's description, its constraints (``maxLength``/``minLength``/``pattern`` on strings,
  ``maximum``/``minimum`` on numbers, ``maxItems``/``minItems`` on arrays) and its default
  (``// Default: …``, numbers and booleans as Python ``repr``, the rest as JSON) as comments.

Not covered: ``$ref``/``$defs`` (the real encoder emits ``interface`` blocks for them). Those raise
:class:`UnsupportedSchema`, and the tokenizer then falls back to the template's compact-JSON
declaration, as the real tokenizer does when its encoder fails.
"""

from __future__ import annotations

import json
from typing import Any

INDENT = "  "


class UnsupportedSchema(ValueError):
    """A JSON Schema construct this encoder does not render."""


def _comment(text: str, indent: str) -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


_CONSTRAINT_KEYS: dict[str, tuple[str, ...]] = {
    "string": ("maxLength", "minLength", "pattern"),
    "number": ("maximum", "minimum"),
    "integer": ("maximum", "minimum"),
    "array": ("maxItems", "minItems"),
}
_UNION_NAMES = {
    "string": "string",
    "number": "number",
    "integer": "number",
    "boolean": "boolean",
    "null": "null",
    "object": "{}",
    "array": "Array<any>",
}


def _kind(schema: dict[str, Any] | bool) -> str:
    """What the schema renders as: scalar, object, array, enum, anyOf or union."""
    if isinstance(schema, bool) or schema == {}:
        return "scalar"
    if "$ref" in schema or "$defs" in schema:
        raise UnsupportedSchema("$ref/$defs are not rendered by this encoder")
    if "anyOf" in schema:
        return "anyOf"
    if "enum" in schema:
        return "enum"
    if "type" not in schema:
        raise UnsupportedSchema(f"schema without a type: {schema!r}")
    if isinstance(schema["type"], list):
        return "union"
    return schema["type"] if schema["type"] in ("object", "array") else "scalar"


def _doc(schema: dict[str, Any] | bool, indent: str) -> str:
    """The comment lines above a field or an array item: description, then constraints."""
    if isinstance(schema, bool):
        return ""
    lines = []
    if schema.get("description"):
        lines.append(_comment(schema["description"], indent))
    kind = _kind(schema)
    type_name = schema.get("type") if kind in ("scalar", "array") else None
    keys = _CONSTRAINT_KEYS.get(type_name, ()) if isinstance(type_name, str) else ()
    constraints = sorted((k, schema[k]) for k in keys if k in schema)
    if constraints:
        lines.append(f"{indent}// " + ", ".join(f"{k}: {v}" for k, v in constraints))
    return "".join(line + "\n" for line in lines)


def _type(schema: dict[str, Any] | bool, indent: str) -> str:
    """The TypeScript type of ``schema``, for a field written at ``indent``."""
    if isinstance(schema, bool):
        return "any" if schema else "null"
    kind = _kind(schema)
    if schema == {}:
        return "any"
    if kind == "anyOf":
        return " | ".join(_type(option, indent) for option in schema["anyOf"])
    if kind == "enum":
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in schema["enum"])
    if kind == "union":
        return " | ".join(_UNION_NAMES[t] for t in schema["type"])
    if kind == "object":
        return _object(schema, indent)
    if kind == "array":
        item = schema.get("items") or {}
        doc = _doc(item, indent + INDENT)
        if doc:
            return f"Array<\n{doc}{indent}{INDENT}{_type(item, indent + INDENT)}\n{indent}>"
        return f"Array<{_type(item, indent)}>"
    return "number" if schema["type"] == "integer" else str(schema["type"])


def _field(name: str, schema: dict[str, Any] | bool, optional: bool, indent: str) -> str:
    text = _doc(schema, indent)
    default = schema.get("default") if isinstance(schema, dict) else None
    if default is not None:
        shown = repr(default) if isinstance(default, (int, float, bool)) else json.dumps(default, ensure_ascii=False)
        text += f"{indent}// Default: {shown}\n"
    return f"{text}{indent}{name}{'?' if optional else ''}: {_type(schema, indent)}"


def _object(schema: dict[str, Any], indent: str) -> str:
    properties: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    names = sorted(n for n in properties if n in required) + sorted(n for n in properties if n not in required)
    inner = indent + INDENT
    fields = [_field(n, properties[n], n not in required, inner) for n in names]
    extra = schema.get("additionalProperties")
    if extra is not None:
        shown = "any" if extra is True else "never" if extra is False else _type(extra, inner)
        fields.append(f"{inner}[k: string]: {shown}")
    if not fields:
        return "{}"
    return "{\n" + ",\n".join(fields) + "\n" + indent + "}"


def _function(function: dict[str, Any]) -> str:
    parameters = function.get("parameters") or {}
    if "$defs" in parameters or "$ref" in json.dumps(parameters):
        raise UnsupportedSchema("$ref/$defs are not rendered by this encoder")
    signature = f"type {function.get('name', 'function')} = (_: {_object(parameters, '')}) => any;"
    description = function.get("description")
    return "\n".join(part for part in (_comment(description, "") if description else "", signature) if part)


def encode_tools_to_typescript_style(tools: list[dict[str, Any]]) -> str:
    """The ``# Tools`` section for OpenAI-style ``tools`` (only ``type: function`` entries count)."""
    functions = [_function(t["function"]) for t in tools or () if t.get("type") == "function" and t.get("function")]
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
