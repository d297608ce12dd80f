"""Merge responses, apply the target's chat template, loss-mask, shuffle, split and shard — in
memory bounded by ``buffer_rows`` and ``shard_rows``, whatever the number of rows.

Pass 1 reads the responses tables batch by batch (first occurrence of an id kept), renders and
masks each conversation (see :mod:`eagle3_pipeline.training_data.masks`), tokenizes ``buffer_rows``
conversations at a time (a fast tokenizer's batch encoder with offsets; a slow one, such as
Kimi-K2.5's remote-code ``TikTokenTokenizer``, in segments at the span edges), and appends the
rows to one of N bucket files on disk by their shuffle key ``sha256("shuffle:{seed}:{id}")`` — bucket *b* holds the
*b*-th of N equal key ranges, N = rows / ``buffer_rows``. Pass 2 reads the buckets in key order,
sorts each in memory, and streams the rows into ``train-NNNNN``/``eval-NNNNN`` shards of exactly
``shard_rows`` rows (the split is decided by another hash of the id), counting the masked tokens of
the train split. The order depends on the seed and the ids only: not on the input order, the
number of buckets, or the batch size.

Held-out slice (``held_out_per_dataset`` N): per dataset, the N kept rows with the smallest
``sha256("held_out:{seed}:{id}")`` (at most half the dataset's rows, so that a small one still
trains), chosen in pass 1 over the rows that survive it and forced into eval in pass 2, whatever
their split hash says. The manifest records them (``held_out``: dataset → ids in key order): the
same ids for the same responses and seed, in any input order.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pyarrow_compute
import pyarrow.parquet as pq

from eagle3_pipeline.records import atomic_directory
from eagle3_pipeline.target.folder import load_tokenizer as load_target_tokenizer
from eagle3_pipeline.training_data.masks import (
    FINISHED,
    ChatRenderer,
    Conversation,
    ReasoningMode,
    Row,
    TemplateMismatch,
    fast_piece_mask,
    template_message,
    tokenize_row,
)

# pyarrow.compute defines its kernels (list_flatten, is_in, ...) at import time, out of a type checker's sight.
pc: Any = pyarrow_compute

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
BUCKET_SCHEMA = SHARD_SCHEMA.append(pa.field("key", pa.uint64())).append(pa.field("split", pa.string()))
FREQ_SCHEMA = pa.schema([("token_id", pa.int32()), ("count", pa.int64())])
RESPONSE_COLUMNS = ("id", "dataset", "messages", "tools")
MISMATCH_EXAMPLES = 5


@dataclass
class DatasetStats:
    rows: int = 0
    tokens: int = 0
    masked_tokens: int = 0
    templated: int = 0
    template_mismatch: int = 0

    def as_metadata(self) -> dict[str, Any]:
        rate = self.template_mismatch / self.templated if self.templated else 0.0
        return {
            "rows": self.rows,
            "tokens": self.tokens,
            "masked_tokens": self.masked_tokens,
            "template_mismatch": self.template_mismatch,
            "template_mismatch_rate": round(rate, 6),
        }


@dataclass
class DataprepStats:
    rows_in: int = 0
    duplicates: int = 0
    empty_responses: int = 0
    no_generated_turn: int = 0
    truncated_turns: int = 0
    over_length: int = 0
    train_rows: int = 0
    eval_rows: int = 0
    per_dataset: dict[str, DatasetStats] = field(default_factory=dict)
    mismatch_examples: list[str] = field(default_factory=list)
    held_out: dict[str, list[str]] = field(default_factory=dict)

    def dataset(self, name: str) -> DatasetStats:
        return self.per_dataset.setdefault(name, DatasetStats())

    @property
    def templated(self) -> int:
        return sum(d.templated for d in self.per_dataset.values())

    @property
    def template_mismatch(self) -> int:
        return sum(d.template_mismatch for d in self.per_dataset.values())

    @property
    def template_mismatch_rate(self) -> float:
        return self.template_mismatch / self.templated if self.templated else 0.0

    @property
    def tokens(self) -> int:
        return sum(d.tokens for d in self.per_dataset.values())

    @property
    def masked_tokens(self) -> int:
        return sum(d.masked_tokens for d in self.per_dataset.values())

    def as_metadata(self) -> dict[str, Any]:
        return {
            "rows": self.train_rows + self.eval_rows,
            "train_rows": self.train_rows,
            "eval_rows": self.eval_rows,
            "held_out_rows": sum(len(ids) for ids in self.held_out.values()),
            "tokens": self.tokens,
            "masked_tokens": self.masked_tokens,
            "responses_read": self.rows_in,
            "duplicates_dropped": self.duplicates,
            "empty_responses_dropped": self.empty_responses,
            "no_generated_turn_dropped": self.no_generated_turn,
            "truncated_turns_kept": self.truncated_turns,
            "over_length_dropped": self.over_length,
            "template_mismatch": self.template_mismatch,
            "template_mismatch_rate": round(self.template_mismatch_rate, 6),
            "template_mismatch_examples": list(self.mismatch_examples),
            "per_dataset": {name: s.as_metadata() for name, s in sorted(self.per_dataset.items())},
        }


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """The target's tokenizer (fast or slow, remote code only with ``trust_remote_code``), which must
    have a chat template."""
    tokenizer = load_target_tokenizer(name_or_path, trust_remote_code, setting="target.tokenizer")
    if not tokenizer.chat_template:
        raise ValueError(
            f"target.tokenizer {name_or_path!r} has no chat template; training_data renders conversations with it"
        )
    return tokenizer


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def split_of(sample_id: str, seed: int, eval_fraction: float) -> str:
    """The split by a hash of its own domain: ``prompts`` samples by ``sha256(f"{seed}:{id}")``
    (the smallest kept), so the same hash here would send a whole small sample to eval."""
    return "eval" if _hash64(f"split:{seed}:{sample_id}") / 2**64 < eval_fraction else "train"


def shuffle_key(sample_id: str, seed: int) -> int:
    return _hash64(f"shuffle:{seed}:{sample_id}")


def held_out_key(sample_id: str, seed: int) -> int:
    """The held-out slice's order, the whole ``sha256("held_out:{seed}:{id}")`` (no two ids tie): per
    dataset the smallest keys are held out (see module doc)."""
    return int.from_bytes(hashlib.sha256(f"held_out:{seed}:{sample_id}".encode()).digest(), "big")


def stored_conversation(row: dict[str, Any], reasoning: ReasoningMode) -> Conversation:
    """A responses-table row (contract C1) as a :class:`Conversation`: the turns with ``generated``
    set are trained on, finished when their ``finish_reason`` is ``stop`` or ``tool_calls``."""
    stored = row["messages"]
    generated = {i: m.get("finish_reason") in FINISHED for i, m in enumerate(stored) if m.get("generated")}
    messages = [template_message(m, i, reasoning) for i, m in enumerate(stored)]
    tools = json.loads(row["tools"]) if row.get("tools") else None
    return Conversation(messages, tools, generated)


def _has_output(message: dict[str, Any]) -> bool:
    return bool((message.get("content") or "").strip() or message.get("tool_calls") or message.get("reasoning_content"))


def _read_rows(path: Path, batch_rows: int) -> Iterator[list[dict[str, Any]]]:
    """Batches of a responses table's rows."""
    parquet = pq.ParquetFile(path)
    schema = parquet.schema_arrow
    missing = [c for c in RESPONSE_COLUMNS if c not in schema.names]
    if missing:
        raise ValueError(f"{path}: column(s) {', '.join(missing)} missing; expected a responses table")
    message_fields = {f.name for f in schema.field("messages").type.value_type}
    if "generated" not in message_fields:
        raise ValueError(
            f"{path}: messages have no 'generated' field (a responses table from before generated turns were "
            "marked); materialize responses again"
        )
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=list(RESPONSE_COLUMNS)):
        yield batch.to_pylist()


@dataclass
class _Pending:
    id: str
    dataset: str
    row: Row


class _Buckets:
    """Pass 1's output: rows appended to N key-range bucket files, one row group per batch."""

    def __init__(self, folder: Path, count: int) -> None:
        self.folder = folder
        self.count = count
        self.writers: dict[int, pq.ParquetWriter] = {}

    def path(self, bucket: int) -> Path:
        return self.folder / f"bucket-{bucket:05d}.parquet"

    def add(self, table: pa.Table) -> None:
        buckets = np.array([(k * self.count) >> 64 for k in table.column("key").to_pylist()], dtype=np.int64)
        for bucket in np.unique(buckets):
            writer = self.writers.get(int(bucket))
            if writer is None:
                writer = self.writers[int(bucket)] = pq.ParquetWriter(self.path(int(bucket)), BUCKET_SCHEMA)
            writer.write_table(table.take(np.flatnonzero(buckets == bucket)))

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


class _ShardWriter:
    """Pass 2's output for one split: shards of exactly ``shard_rows`` rows in arrival order, each
    written a row group at a time so that no shard is ever held whole in memory."""

    def __init__(self, folder: Path, split: str, shard_rows: int, version: _Version) -> None:
        self.folder, self.split, self.shard_rows, self.version = folder, split, shard_rows, version
        self.writer: pq.ParquetWriter | None = None
        self.in_shard = 0
        self.names: list[str] = []
        self.rows = 0

    def add(self, table: pa.Table) -> None:
        table = table.select(SHARD_SCHEMA.names).cast(SHARD_SCHEMA)
        while len(table):
            if self.writer is None:
                self._open()
            part = table.slice(0, self.shard_rows - self.in_shard)
            self._write(part)
            table = table.slice(len(part))
            if self.in_shard == self.shard_rows:
                self._close_shard()

    def close(self) -> None:
        if self.writer is None and not self.names:
            self._open()
        if self.writer is not None:
            self._close_shard()

    def _open(self) -> None:
        name = f"{self.split}-{len(self.names):05d}.parquet"
        self.writer = pq.ParquetWriter(self.folder / name, SHARD_SCHEMA)
        self.names.append(name)
        self.version.shard(name)

    def _write(self, table: pa.Table) -> None:
        assert self.writer is not None
        self.writer.write_table(table)
        self.version.rows(table)
        self.in_shard += len(table)
        self.rows += len(table)

    def _close_shard(self) -> None:
        assert self.writer is not None
        self.writer.close()
        self.writer, self.in_shard = None, 0


class _Version:
    """The training_data version: a hash of the shards' content (not of their file bytes, which vary
    with the writer), kept as one running hash per column so that it does not depend on how the
    rows were chunked on their way into the shards. One per split; :func:`_combined_version` joins them."""

    STREAMS = ("names", "id", "dataset", "input_ids.lengths", "input_ids", "loss_mask.lengths", "loss_mask")

    def __init__(self) -> None:
        self.hashes = {stream: hashlib.sha256() for stream in self.STREAMS}

    def shard(self, name: str) -> None:
        self.hashes["names"].update(name.encode() + b"\0")

    def rows(self, table: pa.Table) -> None:
        for column in ("id", "dataset"):
            self.hashes[column].update("".join(f"{v}\0" for v in table.column(column).to_pylist()).encode())
        for column in ("input_ids", "loss_mask"):
            values = table.column(column)
            self.hashes[f"{column}.lengths"].update(pc.list_value_length(values).to_numpy().astype(np.int64).tobytes())
            self.hashes[column].update(pc.list_flatten(values).to_numpy().tobytes())

    def hexdigest(self) -> str:
        return "".join(h.hexdigest() for h in self.hashes.values())


def _combined_version(parts: Sequence[_Version]) -> str:
    return hashlib.sha256("".join(p.hexdigest() for p in parts).encode()).hexdigest()[:16]


class _Tokenizer:
    """Pass 1's work: conversations → (ids, mask) rows with their split and shuffle key."""

    def __init__(
        self,
        renderer: ChatRenderer,
        seed: int,
        eval_fraction: float,
        max_seq_len: int,
        stats: DataprepStats,
        held_out_per_dataset: int = 0,
    ) -> None:
        self.renderer, self.seed, self.eval_fraction, self.max_seq_len, self.stats = (
            renderer,
            seed,
            eval_fraction,
            max_seq_len,
            stats,
        )
        self.backend = renderer.tokenizer.backend_tokenizer if renderer.fast else None
        self.held_out_per_dataset = held_out_per_dataset
        self.candidates: dict[
            str, list[tuple[int, str]]
        ] = {}  # per dataset a max-heap (negated) of the smallest held-out keys

    def _candidate(self, dataset: str, sample_id: str) -> None:
        if not self.held_out_per_dataset:
            return
        heap = self.candidates.setdefault(dataset, [])
        entry = (-held_out_key(sample_id, self.seed), sample_id)
        if len(heap) < self.held_out_per_dataset:
            heapq.heappush(heap, entry)
        elif entry > heap[0]:  # a smaller key than the largest kept
            heapq.heapreplace(heap, entry)

    def held_out(self) -> dict[str, list[str]]:
        """Per dataset the held-out ids in key order, at most half of its rows (call after pass 1)."""
        chosen = {}
        for dataset, heap in sorted(self.candidates.items()):
            ranked = [sample_id for _, sample_id in sorted(heap, reverse=True)]
            chosen[dataset] = ranked[: self.stats.dataset(dataset).rows // 2]
        return chosen

    def prepare(self, row: dict[str, Any]) -> _Pending | None:
        """Render and locate one row's generated turns; None when the row is dropped (counted)."""
        conversation = stored_conversation(row, self.renderer.reasoning)
        if not conversation.generated:
            self.stats.no_generated_turn += 1
            return None
        if not all(_has_output(conversation.messages[i]) for i in conversation.generated):
            self.stats.empty_responses += 1
            return None
        self.stats.truncated_turns += sum(not finished for finished in conversation.generated.values())
        self.stats.dataset(row["dataset"]).templated += 1
        try:
            return _Pending(row["id"], row["dataset"], self.renderer.row(conversation))
        except TemplateMismatch as exc:
            self._mismatch(row["dataset"], row["id"], exc)
            return None

    def _mismatch(self, dataset: str, row_id: str, exc: TemplateMismatch) -> None:
        self.stats.dataset(dataset).template_mismatch += 1
        if len(self.stats.mismatch_examples) < MISMATCH_EXAMPLES:
            self.stats.mismatch_examples.append(f"{dataset}/{row_id}: {exc}")

    def _tokens(self, batch: Sequence[_Pending]) -> Iterator[tuple[_Pending, list[int], list[int]]]:
        """Each row's ids and mask: a fast tokenizer encodes every piece of the batch at once; a slow
        one tokenizes row by row, a row whose spans its tokens cannot follow counted as a mismatch."""
        if self.backend is not None:
            texts = [piece.text for pending in batch for piece in pending.row.pieces]
            encodings = iter(self.backend.encode_batch(texts, add_special_tokens=False))
            for pending in batch:
                ids, mask = list(pending.row.ids), list(pending.row.mask)
                for piece in pending.row.pieces:
                    encoding = next(encodings)
                    ids += encoding.ids
                    mask += fast_piece_mask(encoding, piece)
                yield pending, ids, mask
            return
        for pending in batch:
            try:
                ids, mask = tokenize_row(self.renderer, pending.row)
            except TemplateMismatch as exc:
                self._mismatch(pending.dataset, pending.id, exc)
                continue
            yield pending, ids, mask

    def tokenize(self, batch: Sequence[_Pending]) -> pa.Table:
        ids_parts, mask_parts, kept = [], [], []
        for pending, id_list, mask_list in self._tokens(batch):
            ids = np.asarray(id_list, dtype=np.int32)
            mask = np.asarray(mask_list, dtype=np.int8)
            if len(ids) > self.max_seq_len:
                self.stats.over_length += 1
                continue
            dataset = self.stats.dataset(pending.dataset)
            dataset.rows += 1
            dataset.tokens += len(ids)
            dataset.masked_tokens += int(mask.sum())
            self._candidate(pending.dataset, pending.id)
            ids_parts.append(ids)
            mask_parts.append(mask)
            kept.append(pending)
        lengths = np.array([len(ids) for ids in ids_parts], dtype=np.int32)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        flat_ids = np.concatenate(ids_parts) if ids_parts else np.zeros(0, np.int32)
        flat_mask = np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.int8)
        return pa.table(
            {
                "id": [p.id for p in kept],
                "dataset": [p.dataset for p in kept],
                "input_ids": pa.ListArray.from_arrays(offsets, pa.array(flat_ids)),
                "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(flat_mask)),
                "num_tokens": pa.array(lengths),
                "num_masked": pa.array([int(m.sum()) for m in mask_parts], pa.int32()),
                "key": pa.array([shuffle_key(p.id, self.seed) for p in kept], pa.uint64()),
                "split": [split_of(p.id, self.seed, self.eval_fraction) for p in kept],
            },
            schema=BUCKET_SCHEMA,
        )


def _tokenize_into(
    buckets: _Buckets, response_files: Sequence[Path], tokenizing: _Tokenizer, buffer_rows: int, stats: DataprepStats
) -> None:
    seen: set[str] = set()
    pending: list[_Pending] = []
    for path in response_files:
        for rows in _read_rows(path, buffer_rows):
            for row in rows:
                stats.rows_in += 1
                if row["id"] in seen:
                    stats.duplicates += 1
                    continue
                seen.add(row["id"])
                prepared = tokenizing.prepare(row)
                if prepared is not None:
                    pending.append(prepared)
                if len(pending) >= buffer_rows:
                    buckets.add(tokenizing.tokenize(pending))
                    pending = []
    if pending:
        buckets.add(tokenizing.tokenize(pending))


def _shard_from(
    buckets: _Buckets, staging: Path, shard_rows: int, vocab_size: int, held_out: Sequence[str] = ()
) -> tuple[dict[str, _ShardWriter], np.ndarray]:
    """Pass 2; the ``held_out`` ids go to eval whatever their split hash says."""
    writers = {split: _ShardWriter(staging, split, shard_rows, _Version()) for split in ("train", "eval")}
    frequencies = np.zeros(vocab_size, dtype=np.int64)
    forced = pa.array(sorted(held_out), pa.string())
    for bucket in range(buckets.count):
        if bucket not in buckets.writers:
            continue
        table = pq.read_table(buckets.path(bucket)).sort_by([("key", "ascending"), ("id", "ascending")])
        if len(forced):
            split = pc.if_else(pc.is_in(table.column("id"), value_set=forced), pa.scalar("eval"), table.column("split"))
            table = table.set_column(table.schema.get_field_index("split"), "split", split)
        for split, writer in writers.items():
            part = table.filter(pc.equal(table.column("split"), split))
            if not len(part):
                continue
            writer.add(part)
            if split == "train":
                ids = pc.list_flatten(part.column("input_ids")).to_numpy()
                mask = pc.list_flatten(part.column("loss_mask")).to_numpy()
                frequencies += np.bincount(ids[mask == 1], minlength=vocab_size)[:vocab_size]
    for writer in writers.values():
        writer.close()
    return writers, frequencies


def build_training_data(
    response_files: Sequence[Path],
    tokenizer_name: str,
    output_dir: Path,
    *,
    seed: int,
    eval_fraction: float,
    shard_rows: int,
    max_seq_len: int,
    reasoning: ReasoningMode = "emit",
    buffer_rows: int = 4096,
    trust_remote_code: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    thinking_markup: tuple[str, str] | None = None,
    held_out_per_dataset: int = 0,
) -> DataprepStats:
    """The whole phase: merge → template + mask → drop over-length → shuffle → split → shards.

    ``reasoning``: ``emit`` (the target's prompt and output for its response, see
    :mod:`eagle3_pipeline.training_data.masks`), ``render`` or ``drop``. ``trust_remote_code`` is
    ``target.trust_remote_code`` (Kimi's tokenizer is remote code). ``chat_template_kwargs`` go to
    every render, as the server got them (Kimi-K2.5: ``{"thinking": False}`` turns thinking off).
    ``thinking_markup`` (open, close) overrides the ``<think>``/``</think>`` added tokens as the
    markup ``emit`` puts reasoning into. ``held_out_per_dataset``: the held-out slice (module doc)."""
    if held_out_per_dataset < 0:
        raise ValueError(f"training_data.held_out_per_dataset must be 0 or more, got {held_out_per_dataset}")
    stats = DataprepStats()
    tokenizer = load_tokenizer(tokenizer_name, trust_remote_code)
    renderer = ChatRenderer(tokenizer, reasoning, chat_template_kwargs, thinking_markup)
    rows_upper_bound = sum(pq.ParquetFile(path).metadata.num_rows for path in response_files)
    vocab_size = len(tokenizer)
    with (
        atomic_directory(output_dir) as staging,
        tempfile.TemporaryDirectory(prefix=".buckets.", dir=staging.parent) as scratch,
    ):
        buckets = _Buckets(Path(scratch), max(1, -(-rows_upper_bound // buffer_rows)))
        tokenizing = _Tokenizer(renderer, seed, eval_fraction, max_seq_len, stats, held_out_per_dataset)
        try:
            _tokenize_into(buckets, response_files, tokenizing, buffer_rows, stats)
        finally:
            buckets.close()
        stats.held_out = tokenizing.held_out()
        writers, frequencies = _shard_from(
            buckets, staging, shard_rows, vocab_size, [i for ids in stats.held_out.values() for i in ids]
        )
        stats.train_rows, stats.eval_rows = writers["train"].rows, writers["eval"].rows
        used = np.flatnonzero(frequencies)
        order = used[np.lexsort((used, -frequencies[used]))]
        freq = pa.table(
            {"token_id": pa.array(order.astype(np.int32)), "count": pa.array(frequencies[order])}, schema=FREQ_SCHEMA
        )
        pq.write_table(freq, staging / "token_freq.parquet")
        manifest = {
            "version": _combined_version([writers["train"].version, writers["eval"].version]),
            "tokenizer": tokenizer_name,
            "tokenizer_kind": "fast" if renderer.fast else "slow",
            "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
            "chat_template_kwargs": renderer.chat_template_kwargs,
            "thinking_markup": list(renderer.thinking_markup) if renderer.thinking_markup else None,
            "seed": seed,
            "eval_fraction": eval_fraction,
            "held_out_per_dataset": held_out_per_dataset,
            "held_out": stats.held_out,
            "max_seq_len": max_seq_len,
            "reasoning": reasoning,
            "shards": {split: writer.names for split, writer in writers.items()},
            "vocab_size": vocab_size,
            **stats.as_metadata(),
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return stats


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; materialize training_data first")
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest
