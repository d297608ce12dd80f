"""Dataset loaders and normalization: ShareGPT / OpenAI records → :class:`PromptRecord`.

Files: JSONL, JSON (a list of records, or an object with a ``data`` list) and Parquet. Hugging
Face datasets by name (``hf:org/name``) when the ``datasets`` package is installed.
A malformed record is skipped and counted (with the first few line numbers); a file that cannot be
read at all is a :class:`PromptSourceError` naming the file and line.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import DatasetConfig, PromptsConfig
from eagle3_pipeline.records import (
    PROMPT_SCHEMA,
    Message,
    PromptRecord,
    content_id,
    message,
    prompt_rows,
    write_parquet,
)
from eagle3_pipeline.results import PromptsResult

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function": "tool",
}
OPENAI_ROLES = {"system", "developer", "user", "assistant", "tool"}
CHARS_PER_TOKEN = 4


class PromptSourceError(ValueError):
    """A dataset source that cannot be read at all."""


class MalformedRecord(ValueError):
    """One record that does not fit the expected format (skipped and counted)."""


@dataclass
class LoadStats:
    read: int = 0
    malformed: int = 0
    malformed_examples: list[str] = field(default_factory=list)
    empty: int = 0
    duplicates: int = 0
    sampled_out: int = 0
    kept: int = 0

    def as_metadata(self) -> dict[str, Any]:
        return {
            "records_read": self.read,
            "malformed_skipped": self.malformed,
            "malformed_examples": "; ".join(self.malformed_examples) or "none",
            "empty_dropped": self.empty,
            "duplicates_dropped": self.duplicates,
            "sampled_out": self.sampled_out,
            "prompts": self.kept,
        }


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield f"line {number}", MalformedRecord("not valid UTF-8")
                continue
            if not line.strip():
                continue
            try:
                yield f"line {number}", json.loads(line)
            except json.JSONDecodeError as exc:
                yield f"line {number}", MalformedRecord(f"invalid JSON ({exc.msg})")


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise PromptSourceError(f"{path}: not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise PromptSourceError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise PromptSourceError(f"{path}: expected a JSON list of records (or an object with a 'data' list)")
    for index, item in enumerate(data):
        yield f"record {index}", item


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise PromptSourceError(f"{path}: not a readable Parquet file ({exc})") from None
    for index, row in enumerate(table.to_pylist()):
        yield f"row {index}", row


def _iter_hub(source: str, split: str) -> Iterator[tuple[str, Any]]:
    try:
        import datasets  # pyright: ignore[reportMissingImports]  # optional: not a dependency of the project
    except ImportError:
        raise PromptSourceError(
            f"{source}: Hugging Face datasets need the 'datasets' package (pip install datasets)"
        ) from None
    name, _, subset = source.removeprefix("hf:").partition(":")
    dataset = datasets.load_dataset(name, subset or None, split=split)
    for index, row in enumerate(dataset):
        yield f"row {index}", row


def iter_source(ds: DatasetConfig) -> Iterator[tuple[str, Any]]:
    """Yield (location, raw record or MalformedRecord) for every record of a dataset source."""
    if ds.is_hub_dataset:
        yield from _iter_hub(ds.source, ds.split)
        return
    path = Path(ds.source)
    suffix = path.suffix.lower()
    try:
        if suffix in {".jsonl", ".ndjson"}:
            yield from _iter_jsonl(path)
        elif suffix == ".json":
            yield from _iter_json(path)
        elif suffix == ".parquet":
            yield from _iter_parquet(path)
        else:
            raise PromptSourceError(f"{path}: unsupported file type {suffix!r} (expected .jsonl, .json or .parquet)")
    except OSError as exc:
        raise PromptSourceError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = [p.get("text", "") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(value):
            return "".join(parts)
    if value is None:
        return ""
    raise MalformedRecord(f"{what} must be a string or a list of text parts")


def _sharegpt_messages(turns: Any) -> list[Message]:
    if not isinstance(turns, list):
        raise MalformedRecord("'conversations' must be a list")
    messages = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise MalformedRecord(f"conversations[{index}] must be an object")
        speaker = str(turn.get("from", "")).lower()
        if speaker not in SHAREGPT_ROLES:
            raise MalformedRecord(f"conversations[{index}].from {turn.get('from')!r} is not a known speaker")
        messages.append(message(SHAREGPT_ROLES[speaker], _text(turn.get("value"), f"conversations[{index}].value")))
    return messages


def _tool_calls(value: Any, where: str) -> str | None:
    """The JSON text of a message's ``tool_calls`` list as the source has it (a list, or JSON text of one)."""
    if value in (None, "", []):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise MalformedRecord(f"{where} is a string but not JSON") from None
    if not isinstance(value, list) or not all(isinstance(call, dict) for call in value):
        raise MalformedRecord(f"{where} must be a list of tool-call objects")
    return json.dumps(value, ensure_ascii=False)


def _optional_text(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise MalformedRecord(f"{where} must be a string")


def _openai_messages(turns: Any) -> list[Message]:
    if not isinstance(turns, list):
        raise MalformedRecord("'messages' must be a list")
    messages = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise MalformedRecord(f"messages[{index}] must be an object")
        role = turn.get("role")
        if role not in OPENAI_ROLES:
            raise MalformedRecord(f"messages[{index}].role {role!r} is not one of {sorted(OPENAI_ROLES)}")
        calls = _tool_calls(turn.get("tool_calls"), f"messages[{index}].tool_calls")
        content: str | None = _text(turn.get("content"), f"messages[{index}].content")
        if not content and calls:
            content = None
        messages.append(
            message(
                "system" if role == "developer" else role,
                content,
                tool_calls=calls,
                tool_call_id=_optional_text(turn.get("tool_call_id"), f"messages[{index}].tool_call_id"),
                name=_optional_text(turn.get("name"), f"messages[{index}].name"),
            )
        )
    return messages


def _tools(raw: Any) -> str | None:
    tools = raw.get("tools")
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise MalformedRecord("'tools' is a string but not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise MalformedRecord("'tools' must be a list of tool schemas")
    return json.dumps(tools, sort_keys=True, ensure_ascii=False)


def parse_record(raw: Any, fmt: str) -> tuple[list[Message], str | None]:
    """Normalize one raw record to (messages ending with the last user turn, tools JSON)."""
    if not isinstance(raw, dict):
        raise MalformedRecord("record must be a JSON object")
    if fmt == "auto":
        fmt = "sharegpt" if "conversations" in raw else "openai" if "messages" in raw else ""
        if not fmt:
            raise MalformedRecord("record has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI)")
    key = "conversations" if fmt == "sharegpt" else "messages"
    if key not in raw:
        raise MalformedRecord(f"record has no {key!r} field (format {fmt})")
    messages = _sharegpt_messages(raw[key]) if fmt == "sharegpt" else _openai_messages(raw[key])
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    if last_user < 0:
        raise MalformedRecord("conversation has no user turn")
    return messages[: last_user + 1], _tools(raw)


def estimate_tokens(messages: Sequence[Message], tools: str | None) -> int:
    """A tokenizer-free estimate (4 characters a token, 4 tokens of framing per message)."""
    chars = sum(len(m.get("content") or "") + len(m.get("tool_calls") or "") for m in messages) + len(tools or "")
    turns = len(messages)
    return math.ceil(chars / CHARS_PER_TOKEN) + 4 * turns


def load_prompts(ds: DatasetConfig, settings: PromptsConfig, seed: int) -> tuple[list[PromptRecord], LoadStats]:
    """Read a dataset source, normalize, drop empty and duplicate prompts, sample deterministically."""
    stats = LoadStats()
    records: list[PromptRecord] = []
    seen: set[str] = set()
    for index, (where, raw) in enumerate(iter_source(ds)):
        stats.read += 1
        try:
            if isinstance(raw, MalformedRecord):
                raise raw
            messages, tools = parse_record(raw, ds.format)
        except MalformedRecord as exc:
            stats.malformed += 1
            if len(stats.malformed_examples) < settings.max_bad_records_listed:
                stats.malformed_examples.append(f"{where}: {exc}")
            continue
        if not (messages[-1]["content"] or "").strip():
            stats.empty += 1
            continue
        record_id = content_id(messages, tools)
        if record_id in seen:
            stats.duplicates += 1
            continue
        seen.add(record_id)
        tokens = estimate_tokens(messages, tools)
        length_class = "long" if tokens > settings.long_threshold_tokens else "short"
        records.append(PromptRecord(record_id, ds.id, messages, tools, length_class, tokens, index))
    if stats.read and not records and stats.malformed == stats.read:
        raise PromptSourceError(
            f"{ds.source}: none of the {stats.read} records is usable; first problems: "
            + "; ".join(stats.malformed_examples)
        )
    if ds.sample_size is not None and len(records) > ds.sample_size:
        kept_ids = {r.id for r in sorted(records, key=lambda r: sample_key(seed, r.id))[: ds.sample_size]}
        stats.sampled_out = len(records) - len(kept_ids)
        records = [r for r in records if r.id in kept_ids]
    stats.kept = len(records)
    return records, stats


@dataclass(frozen=True)
class PromptsPhase:
    """The prompts phase of one dataset: the records written, how they were read, the typed result."""

    records: list[PromptRecord]
    stats: LoadStats
    result: PromptsResult


def write_prompts(ds: DatasetConfig, settings: PromptsConfig, seed: int, path: Path) -> PromptsPhase:
    """The prompts phase of one dataset: :func:`load_prompts`, then the table at ``path``."""
    records, stats = load_prompts(ds, settings, seed)
    write_parquet(prompt_rows(records), PROMPT_SCHEMA, path)
    classes = Counter(r.length_class for r in records)
    result = PromptsResult.from_metadata(
        {
            **stats.as_metadata(),
            "short": classes["short"],
            "long": classes["long"],
            "estimated_prompt_tokens": sum(r.prompt_tokens_est for r in records),
            "source": ds.source,
            "sampling": "smallest sha256(seed:id) first" if ds.sample_size else "all records",
        }
    )
    return PromptsPhase(records, stats, result)


def sample_key(seed: int, record_id: str) -> str:
    """The sampling order: ``sample_size`` keeps the records with the smallest key. A record's key
    depends only on the seed and its own (content-hash) id, so adding or removing source records
    changes a sample only by those records (and the few they push over or under the cut)."""
    return hashlib.sha256(f"{seed}:{record_id}".encode()).hexdigest()
