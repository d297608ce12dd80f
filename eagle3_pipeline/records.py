"""Record types shared by the phases, and atomic writers for the open formats they are stored in."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

LengthClass = Literal["short", "long"]

# One message of a conversation (contract C1). Every field but ``role`` may be null: ``content`` is
# None on an assistant turn that only called tools; ``tool_calls`` is the JSON text of the OpenAI
# ``tool_calls`` list exactly as the source or the server had it; ``tool_call_id``/``name`` belong to
# ``tool`` messages; ``generated`` is True only on assistant turns the target produced in this
# pipeline, which also carry their ``finish_reason`` and (with ``generation.reasoning: keep``) the
# server's ``reasoning_content``.
MESSAGE_FIELDS = (
    "role",
    "content",
    "reasoning_content",
    "tool_calls",
    "tool_call_id",
    "name",
    "generated",
    "finish_reason",
)
MESSAGE_TYPE = pa.list_(
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

Message = dict[str, Any]


def message(role: str, content: str | None, **fields: Any) -> Message:
    """A message with every C1 field present (absent ones null, ``generated`` False)."""
    return normalized({**fields, "role": role, "content": content})


def normalized(row: Mapping[str, Any]) -> Message:
    """``row`` with exactly the C1 fields: missing ones null, ``generated`` False unless set."""
    out: Message = {name: row.get(name) for name in MESSAGE_FIELDS}
    out["generated"] = bool(out["generated"])
    return out


def wire_message(row: Message) -> dict[str, Any]:
    """The OpenAI request form of a stored message: no pipeline fields, ``tool_calls`` as a list."""
    out: dict[str, Any] = {"role": row["role"], "content": row.get("content")}
    if row.get("tool_calls"):
        out["tool_calls"] = json.loads(row["tool_calls"])
    for key in ("tool_call_id", "name"):
        if row.get(key) is not None:
            out[key] = row[key]
    return out


@dataclass(frozen=True)
class PromptRecord:
    """One normalized prompt: a conversation that ends with a user turn."""

    id: str
    dataset: str
    messages: list[Message]
    tools: str | None
    length_class: LengthClass
    prompt_tokens_est: int
    source_index: int

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return json.loads(self.tools) if self.tools else None


PROMPT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("dataset", pa.string()),
        ("messages", MESSAGE_TYPE),
        ("tools", pa.string()),
        ("length_class", pa.string()),
        ("prompt_tokens_est", pa.int64()),
        ("source_index", pa.int64()),
    ]
)

RESPONSE_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("dataset", pa.string()),
        ("messages", MESSAGE_TYPE),
        ("tools", pa.string()),
        ("response", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("latency_s", pa.float64()),
        ("model", pa.string()),
        ("endpoint", pa.string()),
        ("finished_at", pa.float64()),
    ]
)


def content_id(messages: Sequence[Message], tools: str | None) -> str:
    """A stable id: the hash of the canonical JSON of the conversation and its tool schemas.

    Only a message's non-null fields count (``generated: False`` neither), so a plain
    role/content conversation keeps the id it had before messages gained their other fields."""
    identity = [{k: v for k, v in m.items() if v is not None and k != "generated"} for m in messages]
    canonical = json.dumps({"messages": identity, "tools": tools}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:20]


def prompt_rows(records: Sequence[PromptRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]


def read_prompts(path: Path) -> list[PromptRecord]:
    table = pq.read_table(path)
    return [PromptRecord(**row) for row in table.to_pylist()]


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; rename it into place only if the block succeeds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `final`; swap it into place if the block succeeds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_parquet(rows: Sequence[dict[str, Any]], schema: pa.Schema, final: Path) -> None:
    table = pa.Table.from_pylist(list(rows), schema=schema)
    with atomic_path(final) as tmp:
        pq.write_table(table, tmp)


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes, read a megabyte at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
