"""Checkpoints load with ``weights_only=True``: a trainer-written checkpoint (tensors, optimizer and scheduler
state, RNG states, the curve) loads and resumes (test_train.py); a ``state.pt`` whose pickle would run code is
refused, and the code never runs."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from eagle3_pipeline.drafter.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from eagle3_pipeline.drafter.train.phase import run
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.train_settings import random_store_train_spec


class _Planted:
    """What an attacker's state.pt holds: unpickling it would call ``os.system``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_trainer_checkpoint_loads_weights_only(tmp_path: Path) -> None:
    spec = random_store_train_spec(tmp_path, epochs=1, checkpoint_every=2)
    run(spec, Recorder())
    found = latest_checkpoint(tmp_path / "run")
    assert found is not None
    state, d2t, t2d = load_checkpoint(found)
    assert {"model", "optimizer"} <= set(state) and d2t.dtype == torch.int64 and t2d.dtype == torch.bool


def test_a_checkpoint_whose_pickle_runs_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    folder = save_checkpoint(
        tmp_path / "run", 1, {"model": {}}, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.bool), 1
    )
    with (folder / "state.pt").open("wb") as handle:
        torch.save({"model": {}, "rng": _Planted(marker)}, handle)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_checkpoint(folder)
    assert not marker.exists()
