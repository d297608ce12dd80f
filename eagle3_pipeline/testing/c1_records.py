"""Responses tables as generation writes them (``records.MESSAGE_TYPE``), built by hand for the
training_data tests and benchmark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from eagle3_pipeline.generation.conversation import RESPONSE_TABLE_SCHEMA
from eagle3_pipeline.records import MESSAGE_TYPE, write_parquet

C1_MESSAGE_FIELDS = tuple(field.name for field in MESSAGE_TYPE.value_type)
# The columns training_data reads, typed as generation writes them.
C1_RESPONSE_SCHEMA = pa.schema(
    [
        RESPONSE_TABLE_SCHEMA.field(name)
        for name in ("id", "dataset", "messages", "tools", "response", "finish_reason", "reasoning")
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


def response_row(
    row_id: str, dataset: str, messages: list[dict[str, Any]], tools: list[Any] | None = None
) -> dict[str, Any]:
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
