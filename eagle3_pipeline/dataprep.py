"""Merge responses, apply the target's chat template, loss-mask, shuffle, split and shard.

The loss mask covers the tokens of target-generated assistant turns (their content and the
template's end-of-turn marker), found by rendering the conversation prefix by prefix: the span of turn *i* is
what ``render(messages[:i+1])`` adds to ``render(messages[:i], add_generation_prompt=True)``.
A template for which that prefix property does not hold is reported per sample, never guessed.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_pipeline.generation.conversation import turns_to_regenerate
from eagle3_pipeline.records import atomic_directory

SHARD_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("dataset", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_tokens", pa.int32()),
        ("num_masked", pa.int32()),
    ]
)
FREQ_SCHEMA = pa.schema([("token_id", pa.int32()), ("count", pa.int64())])


class TemplateMismatch(ValueError):
    """The chat template renders a prefix that is not a prefix of the whole conversation."""


@dataclass(frozen=True)
class Sample:
    id: str
    dataset: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class DataprepStats:
    rows_in: int = 0
    duplicates: int = 0
    empty_responses: int = 0
    truncated_responses: int = 0
    over_length: int = 0
    template_mismatch: int = 0
    train_rows: int = 0
    eval_rows: int = 0
    tokens: int = 0
    masked_tokens: int = 0
    per_dataset: Counter[str] = field(default_factory=Counter)

    def as_metadata(self) -> dict[str, Any]:
        return {
            "rows": self.train_rows + self.eval_rows,
            "train_rows": self.train_rows,
            "eval_rows": self.eval_rows,
            "tokens": self.tokens,
            "masked_tokens": self.masked_tokens,
            "responses_read": self.rows_in,
            "duplicates_dropped": self.duplicates,
            "empty_responses_dropped": self.empty_responses,
            "truncated_responses_kept": self.truncated_responses,
            "over_length_dropped": self.over_length,
            "template_mismatch_dropped": self.template_mismatch,
            "per_dataset": dict(sorted(self.per_dataset.items())),
        }


def load_tokenizer(name_or_path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer {name_or_path!r} is not a fast tokenizer; offsets are needed for loss masks")
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer {name_or_path!r} has no chat template")
    return tokenizer


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], tools: list[Any] | None, generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )
    return str(text)


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    tools: list[Any] | None,
    masked_turns: set[int],
) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and a 0/1 mask over the assistant turns listed."""
    full = _render(tokenizer, messages, tools, generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for index in sorted(masked_turns):
        before = _render(tokenizer, messages[:index], tools, generation_prompt=True)
        through = _render(tokenizer, messages[: index + 1], tools, generation_prompt=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise TemplateMismatch(f"turn {index}: rendered prefix is not a prefix of the conversation")
        spans.append((len(before), len(through)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    mask = [int(any(start <= begin < end for start, end in spans)) for begin, _ in encoded["offset_mapping"]]
    return ids, mask


def split_of(sample_id: str, seed: int, eval_fraction: float) -> str:
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction else "train"


def merge_responses(tables: Sequence[pa.Table], stats: DataprepStats) -> list[dict[str, Any]]:
    """All partitions' rows, first occurrence of each id kept, empty responses dropped."""
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for table in tables:
        for row in table.to_pylist():
            stats.rows_in += 1
            if row["id"] in seen:
                stats.duplicates += 1
                continue
            seen.add(row["id"])
            if not (row.get("response") or "").strip():
                stats.empty_responses += 1
                continue
            if row.get("finish_reason") == "length":
                stats.truncated_responses += 1
            rows.append(row)
    return rows


def generated_turns(messages: Sequence[dict[str, str]], turns: int, every_assistant_turn: bool) -> set[int]:
    """The assistant turns to train on: the final one; the earlier ones the target regenerated
    (a response of more than one turn, see `generation.regenerate_turns`); or, on request,
    every assistant turn."""
    last = len(messages) - 1
    if every_assistant_turn:
        return {i for i, m in enumerate(messages) if m["role"] == "assistant"}
    earlier = turns_to_regenerate(messages[:last], "all") if turns > 1 else []
    return {*earlier, last}


def build_samples(
    rows: Sequence[dict[str, Any]],
    tokenizer: Any,
    max_seq_len: int,
    mask_prior_assistant_turns: bool,
    stats: DataprepStats,
) -> tuple[list[Sample], Counter[int]]:
    samples: list[Sample] = []
    frequencies: Counter[int] = Counter()
    for row in rows:
        messages = row["messages"]
        tools = json.loads(row["tools"]) if row.get("tools") else None
        masked = generated_turns(messages, int(row.get("turns") or 1), mask_prior_assistant_turns)
        try:
            ids, mask = tokenize_conversation(tokenizer, messages, tools, masked)
        except TemplateMismatch:
            stats.template_mismatch += 1
            continue
        if len(ids) > max_seq_len:
            stats.over_length += 1
            continue
        frequencies.update(t for t, m in zip(ids, mask, strict=True) if m)
        samples.append(Sample(row["id"], row["dataset"], ids, mask))
    return samples, frequencies


def shuffle_and_split(samples: Sequence[Sample], seed: int, eval_fraction: float) -> dict[str, list[Sample]]:
    ordered = sorted(samples, key=lambda s: s.id)
    random.Random(seed).shuffle(ordered)
    splits: dict[str, list[Sample]] = {"train": [], "eval": []}
    for sample in ordered:
        splits[split_of(sample.id, seed, eval_fraction)].append(sample)
    return splits


def _write_shards(folder: Path, split: str, samples: Sequence[Sample], shard_rows: int) -> list[str]:
    names = []
    for shard, start in enumerate(range(0, max(len(samples), 1), shard_rows)):
        chunk = samples[start : start + shard_rows]
        rows = [
            {
                "id": s.id,
                "dataset": s.dataset,
                "input_ids": s.input_ids,
                "loss_mask": s.loss_mask,
                "num_tokens": len(s.input_ids),
                "num_masked": sum(s.loss_mask),
            }
            for s in chunk
        ]
        name = f"{split}-{shard:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=SHARD_SCHEMA), folder / name)
        names.append(name)
    return names


def build_training_data(
    response_files: Sequence[Path],
    tokenizer_name: str,
    output_dir: Path,
    seed: int,
    eval_fraction: float,
    shard_rows: int,
    max_seq_len: int,
    mask_prior_assistant_turns: bool = False,
) -> DataprepStats:
    """The whole phase: merge → tokenize + mask → drop over-length → shuffle → split → shards."""
    stats = DataprepStats()
    rows = merge_responses([pq.read_table(path) for path in response_files], stats)
    tokenizer = load_tokenizer(tokenizer_name)
    samples, frequencies = build_samples(rows, tokenizer, max_seq_len, mask_prior_assistant_turns, stats)
    splits = shuffle_and_split(samples, seed, eval_fraction)
    with atomic_directory(output_dir) as staging:
        shards = {split: _write_shards(staging, split, items, shard_rows) for split, items in splits.items()}
        freq_rows = [{"token_id": t, "count": c} for t, c in sorted(frequencies.items(), key=lambda kv: (-kv[1], kv[0]))]
        pq.write_table(pa.Table.from_pylist(freq_rows, schema=FREQ_SCHEMA), staging / "token_freq.parquet")
        stats.train_rows, stats.eval_rows = len(splits["train"]), len(splits["eval"])
        stats.tokens = sum(len(s.input_ids) for s in samples)
        stats.masked_tokens = sum(frequencies.values())
        stats.per_dataset.update(s.dataset for s in samples)
        manifest = {
            "tokenizer": tokenizer_name,
            "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
            "seed": seed,
            "eval_fraction": eval_fraction,
            "max_seq_len": max_seq_len,
            "shards": shards,
            "vocab_size": len(tokenizer),
            **stats.as_metadata(),
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return stats
