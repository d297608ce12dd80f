"""The stall rule of a hidden-state extraction, on real store files (no model needed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from eagle3_pipeline.hidden_states.sharding import (
    ShardAssignment,
    extraction_quiet_seconds,
    write_assignment,
)
from eagle3_pipeline.hidden_states.store import ShardWriter
from eagle3_pipeline.testing.stores import random_states_sample

ASSIGNED = [ShardAssignment(f"shard-0000{i}", "train", "train-00000.parquet", 0, ("a",), 6) for i in range(2)]


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_quiet_counts_from_the_assignment_then_from_the_last_shard(tmp_path: Path) -> None:
    started = time.time() - 1000
    assert extraction_quiet_seconds(tmp_path, started) is None  # no assignment: still waiting or loading
    write_assignment(tmp_path, 4096, ASSIGNED)
    _age(tmp_path / "shards.json", 700)
    assert extraction_quiet_seconds(tmp_path, started) == pytest.approx(700, abs=5)
    writer = ShardWriter(tmp_path, 0)
    writer.add("a", "B1", split="train", **random_states_sample(6, 0))
    writer.close()
    _age(tmp_path / "shard-00000.index.parquet", 30)
    assert extraction_quiet_seconds(tmp_path, started) == pytest.approx(30, abs=5)


def test_an_assignment_left_by_an_earlier_run_is_not_this_runs_progress(tmp_path: Path) -> None:
    write_assignment(tmp_path, 4096, ASSIGNED)
    _age(tmp_path / "shards.json", 3600)
    assert extraction_quiet_seconds(tmp_path, started_after=time.time() - 60) is None
