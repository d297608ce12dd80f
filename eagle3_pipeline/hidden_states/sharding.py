"""Which samples go into which store shard, and how far an extraction has got.

The assignment of rows to store shards is a pure function of the ``training_data`` shards (their
order and the ``num_tokens`` column) and ``shard_tokens``: splits in order (train, eval), each split's
shards in manifest order, rows in order, cut into store shards of about ``shard_tokens`` tokens that
never span two ``training_data`` shards. So a rerun after a kill computes the same assignment and
redoes only the shards that are not complete. The assignment is also written to the store
(``shards.json``) so that :func:`extraction_progress` and :func:`extraction_quiet_seconds` can tell
how far a running extraction has got without the model; a rerun recomputes the assignment and never
reads the file.

In rolling mode (``hidden_states.rolling_window_shards``) the store keeps only its eval shards; the
train shards come and go a window at a time (:mod:`eagle3_pipeline.drafter.train.rolling`).
:func:`rolling_layout` records beforehand where every train row will lie (shards are written in
assignment order, so a row's offset is the sum of the lengths before it), its dataset and its
loss-masked tokens, and the windows: so the trainer knows every epoch and window, and its total steps,
before a single train shard exists.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.hidden_states.store import HiddenStateStore, StoreError, shard_name
from eagle3_pipeline.training_data.reader import SPLITS, TrainingData, TrainingDataError, iter_rows, read_column

ASSIGNMENT_FILE = "shards.json"
ROLLING_LAYOUT_FILE = "rolling_layout.json"


@dataclass(frozen=True)
class ShardAssignment:
    """One store shard and the ``training_data`` rows assigned to it: ``sample_ids`` from row ``start``
    of ``source`` (a ``split`` file), ``tokens`` in all."""

    name: str
    split: str
    source: str
    start: int
    sample_ids: tuple[str, ...]
    tokens: int


def assign_shards(data: TrainingData, shard_tokens: int) -> list[ShardAssignment]:
    assigned: list[ShardAssignment] = []
    for split in SPLITS:
        for path in data.shard_files(split):
            ids = read_column(path, "id")
            lengths = read_column(path, "num_tokens")
            start, tokens = 0, 0
            for row, length in enumerate(lengths):
                tokens += int(length)
                if tokens >= shard_tokens or row == len(lengths) - 1:
                    assigned.append(
                        ShardAssignment(
                            shard_name(len(assigned)), split, path.name, start, tuple(ids[start : row + 1]), tokens
                        )
                    )
                    start, tokens = row + 1, 0
    return assigned


def _write_json(root: Path, name: str, document: dict[str, Any], indent: int | None = 1) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.tmp"
    tmp.write_text(json.dumps(document, indent=indent))
    os.replace(tmp, root / name)


def write_assignment(
    root: Path, shard_tokens: int, assigned: list[ShardAssignment], kept: list[str] | None = None
) -> None:
    """``kept``: in rolling mode, the shards the finished store holds (its eval shards)."""
    document: dict[str, Any] = {
        "shard_tokens": shard_tokens,
        "shards": [
            {k: v for k, v in asdict(s).items() if k != "sample_ids"} | {"samples": len(s.sample_ids)} for s in assigned
        ],
    }
    if kept is not None:
        document["kept"] = kept
    _write_json(root, ASSIGNMENT_FILE, document)


@dataclass(frozen=True)
class LayoutRow:
    """Where a train row will lie in its shard, and what the τ curve counts of it."""

    shard: str
    offset: int
    length: int
    dataset: str
    num_masked: int


@dataclass(frozen=True)
class RollingLayout:
    window_shards: int
    windows: list[list[str]]
    eval_shards: list[str]
    rows: list[LayoutRow]

    def identity(self) -> dict[str, Any]:
        """What a rolling drafter's checkpoint must share with this layout (the windows' shards)."""
        return {"window_shards": self.window_shards, "windows": self.windows}

    def window_rows(self, window: int) -> list[LayoutRow]:
        names = set(self.windows[window])
        return [r for r in self.rows if r.shard in names]


def rolling_layout(data: TrainingData, assigned: list[ShardAssignment], window_shards: int) -> RollingLayout:
    """The train rows' future places (read from ``training_data``: lengths, datasets, loss masks) and
    the windows: the train shards in assignment order, ``window_shards`` at a time."""
    train = [s for s in assigned if s.split == "train"]
    rows: list[LayoutRow] = []
    reader: Any = iter(())
    source: tuple[str, int] | None = None
    for shard in train:
        if source != (shard.source, shard.start):
            reader = iter_rows(data.folder / shard.source, ["id", "dataset", "loss_mask"], shard.start)
        offset = 0
        for sample_id in shard.sample_ids:
            row = next(reader, None)
            if row is None or row["id"] != sample_id:
                raise TrainingDataError(
                    f"{data.folder / shard.source}: rows changed while laying out {shard.name}; rerun"
                )
            length = len(row["loss_mask"])
            rows.append(LayoutRow(shard.name, offset, length, row["dataset"], int(sum(row["loss_mask"]))))
            offset += length
        source = (shard.source, shard.start + len(shard.sample_ids))
    names = [s.name for s in train]
    windows = [names[i : i + window_shards] for i in range(0, len(names), window_shards)]
    return RollingLayout(window_shards, windows, [s.name for s in assigned if s.split == "eval"], rows)


def write_rolling_layout(root: Path, layout: RollingLayout) -> None:
    document = {
        "window_shards": layout.window_shards,
        "windows": layout.windows,
        "eval_shards": layout.eval_shards,
        "rows": [[r.shard, r.offset, r.length, r.dataset, r.num_masked] for r in layout.rows],
    }
    _write_json(root, ROLLING_LAYOUT_FILE, document, indent=None)


def read_rolling_layout(root: Path) -> RollingLayout:
    path = Path(root) / ROLLING_LAYOUT_FILE
    if not path.is_file():
        raise StoreError(
            f"{path}: no rolling layout; materialize hidden_states with hidden_states.rolling_window_shards set"
        )
    try:
        document = json.loads(path.read_text())
        rows = [LayoutRow(str(r[0]), int(r[1]), int(r[2]), str(r[3]), int(r[4])) for r in document["rows"]]
        return RollingLayout(int(document["window_shards"]), document["windows"], document["eval_shards"], rows)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise StoreError(
            f"{path}: not a rolling layout ({type(exc).__name__}: {exc}); materialize hidden_states again"
        ) from None


@dataclass(frozen=True)
class ExtractionProgress:
    """How far the extraction into one store has got (for `status` and the stall sensor)."""

    store: str
    shards_total: int
    shards_done: int
    tokens_total: int
    tokens_done: int
    bytes: int
    last_write_age_s: float | None
    finished: bool

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens_done if self.tokens_done else 0.0

    def line(self) -> str:
        state = "finished" if self.finished else "in progress"
        return (
            f"hidden_states: {self.shards_done}/{self.shards_total} shards, {self.tokens_done}/{self.tokens_total} "
            f"tokens, {self.bytes_per_token:,.0f} B/token, {state}"
        )


def extraction_progress(root: Path, now: float | None = None) -> ExtractionProgress | None:
    """Shards done against the assignment (``shards.json``), bytes/token so far and the age of the last
    shard written; ``None`` when no extraction has written its assignment to ``root``. Reads files only
    (no model, no torch)."""
    root = Path(root)
    assignment_path = root / ASSIGNMENT_FILE
    if not assignment_path.is_file():
        return None
    document = json.loads(assignment_path.read_text())
    shards = document["shards"]
    done = [s for s in shards if (root / f"{s['name']}.index.parquet").is_file()]
    tensor_files = [root / f"{s['name']}.safetensors" for s in done]
    last = max(((root / f"{s['name']}.index.parquet").stat().st_mtime for s in done), default=None)
    store = HiddenStateStore(root)
    kept = document.get("kept", [s["name"] for s in shards])
    finished = store.index_path.is_file() and store.manifest_path.is_file() and store.manifest().shards == kept
    now = time.time() if now is None else now
    return ExtractionProgress(
        store=str(root),
        shards_total=len(shards),
        shards_done=len(done),
        tokens_total=sum(s["tokens"] for s in shards),
        tokens_done=sum(s["tokens"] for s in done),
        bytes=sum(p.stat().st_size for p in tensor_files if p.is_file()),
        last_write_age_s=None if last is None else now - last,
        finished=finished,
    )


def extraction_quiet_seconds(root: Path, started_after: float, now: float | None = None) -> float | None:
    """Seconds since the extraction into ``root`` last showed progress (its assignment written, or a
    shard finished); ``None`` when no unfinished extraction was started at or after ``started_after`` (a
    run still waiting for the `gpu` pool or loading the target has not written its assignment yet)."""
    assignment_path = Path(root) / ASSIGNMENT_FILE
    try:
        assigned_at = assignment_path.stat().st_mtime
    except FileNotFoundError:
        return None
    progress = extraction_progress(root, now)
    if assigned_at < started_after or progress is None or progress.finished:
        return None
    now = time.time() if now is None else now
    quiet = now - assigned_at
    return quiet if progress.last_write_age_s is None else min(quiet, progress.last_write_age_s)
