"""What a finished responses table looks like: schema, duplicate ids, empty answers, truncation."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_pipeline.generation.conversation import RESPONSE_TABLE_SCHEMA

EXAMPLES = 5


@dataclass(frozen=True)
class ResponseTableQuality:
    rows: int
    schema_problems: tuple[str, ...]
    duplicate_ids: tuple[str, ...]
    empty_ids: tuple[str, ...]
    truncated: int

    @property
    def truncation_rate(self) -> float:
        return self.truncated / self.rows if self.rows else 0.0


def schema_problems(actual: pa.Schema, expected: pa.Schema = RESPONSE_TABLE_SCHEMA) -> tuple[str, ...]:
    problems = []
    for field in expected:
        index = actual.get_field_index(field.name)
        if index < 0:
            problems.append(f"column {field.name!r} is missing")
        elif not actual.field(index).type.equals(field.type):
            problems.append(f"column {field.name!r} is {actual.field(index).type}, expected {field.type}")
    return tuple(problems)


def inspect_responses(path: Path) -> ResponseTableQuality:
    """Reads the schema, then only the three columns the checks look at (not the conversations)."""
    schema = pq.read_schema(path)
    problems = schema_problems(schema)
    table = pq.read_table(path, columns=[c for c in ("id", "response", "finish_reason") if c in schema.names])
    names = set(table.column_names)
    ids = table.column("id").to_pylist() if "id" in names else []
    duplicates = tuple(sorted(i for i, n in Counter(ids).items() if n > 1))
    answers = table.column("response").to_pylist() if "response" in names else []
    empty = tuple(i for i, text in zip(ids, answers, strict=False) if not (text or "").strip())
    finish = table.column("finish_reason").to_pylist() if "finish_reason" in names else []
    return ResponseTableQuality(table.num_rows, problems, duplicates, empty, sum(1 for f in finish if f == "length"))
