"""Responses tables in the form of contract C1, written by the dataprep tests.

The generation side (records.MESSAGE_TYPE) adopts this message struct in its own branch; until
both meet on main, these tests build their tables from this copy of the contract. C1_MESSAGE_TYPE
must equal records.MESSAGE_TYPE once both are merged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from eagle3_pipeline.records import write_parquet

C1_MESSAGE_FIELDS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name", "generated", "finish_reason")
C1_MESSAGE_TYPE = pa.list_(
    pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("reasoning_content", pa.string()),
            ("tool_calls", pa.string()),
            ("tool_call_id", pa.string()),
            ("name", pa.string()),
            ("generated", pa.bool_()),
            ("finish_reason", pa.string()),
        ]
    )
)
C1_RESPONSE_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("dataset", pa.string()),
        ("messages", C1_MESSAGE_TYPE),
        ("tools", pa.string()),
        ("response", pa.string()),
        ("finish_reason", pa.string()),
        ("reasoning", pa.string()),
    ]
)


def message(role: str, content: str | None = None, **fields: Any) -> dict[str, Any]:
    """A C1 message: every field present, ``tool_calls`` given as a list is stored as its JSON text."""
    out: dict[str, Any] = {name: None for name in C1_MESSAGE_FIELDS}
    out.update(fields, role=role, content=content, generated=bool(fields.get("generated")))
    if isinstance(out["tool_calls"], list):
        out["tool_calls"] = json.dumps(out["tool_calls"])
    return out


def generated(content: str | None, finish_reason: str = "stop", **fields: Any) -> dict[str, Any]:
    return message("assistant", content, generated=True, finish_reason=finish_reason, **fields)


def response_row(row_id: str, dataset: str, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> dict[str, Any]:
    final = messages[-1]
    return {
        "id": row_id,
        "dataset": dataset,
        "messages": messages,
        "tools": json.dumps(tools) if tools else None,
        "response": final["content"],
        "finish_reason": final["finish_reason"],
        "reasoning": final["reasoning_content"],
    }


def write_responses(path: Path, rows: list[dict[str, Any]]) -> Path:
    write_parquet(rows, C1_RESPONSE_SCHEMA, path)
    return path
