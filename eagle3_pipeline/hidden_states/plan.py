"""Which samples go into which store shard, and how far an extraction has got.

The plan is a pure function of the ``training_data`` shards (their order and the ``num_tokens``
column) and ``shard_tokens``: splits in order (train, eval), each split's shards in manifest order,
rows in order, cut into store shards of about ``shard_tokens`` tokens that never span two
``training_data`` shards. So a rerun after a kill computes the same plan and redoes only the shards
that are not complete. The plan is also written to the store (``plan.json``) so that
:func:`extraction_progress` can tell how far a running extraction has got without the model.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_pipeline.hidden_states.inputs import SPLITS, TrainingData, read_column
from eagle3_pipeline.hidden_states.store import HiddenStateStore, shard_name

PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class PlannedShard:
    name: str
    split: str
    source: str
    start: int
    sample_ids: tuple[str, ...]
    tokens: int


def plan_shards(data: TrainingData, shard_tokens: int) -> list[PlannedShard]:
    planned: list[PlannedShard] = []
    for split in SPLITS:
        for path in data.shard_files(split):
            ids = read_column(path, "id")
            lengths = read_column(path, "num_tokens")
            start, tokens = 0, 0
            for row, length in enumerate(lengths):
                tokens += int(length)
                if tokens >= shard_tokens or row == len(lengths) - 1:
                    planned.append(PlannedShard(shard_name(len(planned)), split, path.name, start, tuple(ids[start : row + 1]), tokens))
                    start, tokens = row + 1, 0
    return planned


def write_plan(root: Path, shard_tokens: int, planned: list[PlannedShard]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    document = {
        "shard_tokens": shard_tokens,
        "shards": [{k: v for k, v in asdict(s).items() if k != "sample_ids"} | {"samples": len(s.sample_ids)} for s in planned],
    }
    tmp = root / f".{PLAN_FILE}.tmp"
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, root / PLAN_FILE)


@dataclass(frozen=True)
class ExtractionProgress:
    """How far the extraction into one store has got (for `status` and the stall sensor)."""

    store: str
    shards_planned: int
    shards_done: int
    tokens_planned: int
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
            f"hidden_states: {self.shards_done}/{self.shards_planned} shards, {self.tokens_done}/{self.tokens_planned} tokens, "
            f"{self.bytes_per_token:,.0f} B/token, {state}"
        )


def extraction_progress(root: Path, now: float | None = None) -> ExtractionProgress | None:
    """Shards done against the plan, bytes/token so far and the age of the last shard written;
    ``None`` when no extraction has started in ``root``. Reads files only (no model, no torch)."""
    root = Path(root)
    plan_path = root / PLAN_FILE
    if not plan_path.is_file():
        return None
    shards = json.loads(plan_path.read_text())["shards"]
    done = [s for s in shards if (root / f"{s['name']}.index.parquet").is_file()]
    tensor_files = [root / f"{s['name']}.safetensors" for s in done]
    last = max(((root / f"{s['name']}.index.parquet").stat().st_mtime for s in done), default=None)
    store = HiddenStateStore(root)
    finished = store.index_path.is_file() and store.manifest_path.is_file() and store.manifest().shards == [s["name"] for s in shards]
    now = time.time() if now is None else now
    return ExtractionProgress(
        store=str(root),
        shards_planned=len(shards),
        shards_done=len(done),
        tokens_planned=sum(s["tokens"] for s in shards),
        tokens_done=sum(s["tokens"] for s in done),
        bytes=sum(p.stat().st_size for p in tensor_files if p.is_file()),
        last_write_age_s=None if last is None else now - last,
        finished=finished,
    )


def extraction_quiet_seconds(root: Path, started_after: float, now: float | None = None) -> float | None:
    """Seconds since the extraction into ``root`` last showed progress (its plan written, or a shard
    finished); ``None`` when no unfinished extraction was started at or after ``started_after`` (a
    run still waiting for the `gpu` pool or loading the target has not written its plan yet)."""
    plan_path = Path(root) / PLAN_FILE
    try:
        planned_at = plan_path.stat().st_mtime
    except FileNotFoundError:
        return None
    progress = extraction_progress(root, now)
    if planned_at < started_after or progress is None or progress.finished:
        return None
    now = time.time() if now is None else now
    quiet = now - planned_at
    return quiet if progress.last_write_age_s is None else min(quiet, progress.last_write_age_s)
