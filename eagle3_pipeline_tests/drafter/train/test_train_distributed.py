"""The train phase in several processes: torchrun with DistributedDataParallel on the CPU (gloo).

Two ranks on this 2-core machine stand in for two GPUs (NCCL is the same code path with another
backend; no multi-GPU run happened here). The made-up target and random store of test_train keep a
run to seconds. Tolerance of "the same weights": float32 sums taken in another order (a rank sums
its share, the all-reduce adds the shares) leave weights ~2e-7 apart after 15 steps here (printed),
and AdamW (update ≈ lr · sign(grad) on near-zero gradients) could amplify that on other data; a bug
(a rank training on the wrong rows, unsynced gradients, a loss normalised per rank) moves losses
and weights by ~1e-2 — the tolerance is atol 1e-5, rtol 1e-4 in between.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
import torch

from eagle3_pipeline.compute import worker_argv
from eagle3_pipeline.drafter.export.specforge import load_export
from eagle3_pipeline.drafter.train.checkpoint import latest_checkpoint, load_checkpoint
from eagle3_pipeline.drafter.train.data import epoch_batches, store_rows
from eagle3_pipeline.drafter.train.phase import run
from eagle3_pipeline.hidden_states.store import HiddenStateStore
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.train_settings import random_store_train_spec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
ATOL, RTOL = 1e-5, 1e-4
# Batches of one or two samples (lengths 20..24): a rank splits some and stands in for others.
SETTINGS = {"batch_tokens": 40, "epochs": 1, "checkpoint_every": 3, "log_every": 2}


def _write(tmp_path: Path, spec: dict[str, Any], name: str) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    return path


def _elsewhere(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    return {**spec, "run_dir": str(folder / "run"), "export_dir": str(folder / "export")}


def _torchrun(spec_file: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        return subprocess.Popen(
            worker_argv("train", str(spec_file), sys.executable, 2),
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _ranks_of(spec_file: Path) -> list[str]:
    """Live processes started with this spec (ranks have sessions of their own: killpg of the
    launcher's group does not reach them)."""
    listing = subprocess.run(["ps", "-ww", "-eo", "stat=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in listing.splitlines() if str(spec_file) in line and not line.startswith("Z")]


def _final_state(run_dir: str) -> dict[str, torch.Tensor]:
    found = latest_checkpoint(Path(run_dir))
    assert found is not None
    state, _, _ = load_checkpoint(found)
    return state["model"]


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    print(f"-- largest weight difference: {max(float((a[n].float() - b[n].float()).abs().max()) for n in a):.2e}")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=ATOL, rtol=RTOL, msg=lambda m, name=name: f"{name}: {m}")


def _metadata(log: Path) -> dict[str, Any]:
    """Rank 0 prints the phase's metadata as the one JSON line of the launch's output."""
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    assert len(lines) == 1, log.read_text()[-3000:]
    return json.loads(lines[0])


def test_two_torchrun_processes_end_with_the_weights_of_one_process(tmp_path: Path) -> None:
    spec = random_store_train_spec(tmp_path, **SETTINGS)
    batches = epoch_batches(store_rows(HiddenStateStore(Path(spec["store"])), "train"), 7, 0, 40, 32)
    assert {len(rows) for rows in batches} == {1, 2}  # both a split batch and a stand-in rank occur
    one = run(spec, Recorder())

    log = tmp_path / "torchrun.log"
    two_spec = _elsewhere(spec, tmp_path / "two")
    process = _torchrun(_write(tmp_path, two_spec, "two"), log)
    assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
    two = _metadata(log)
    print(
        f"\n-- 1 process: loss {one['first_loss']:.5f} -> {one['last_loss']:.5f}; "
        f"2 processes: {two['first_loss']:.5f} -> {two['last_loss']:.5f}"
    )
    assert two["processes"] == 2 and one["processes"] == 1
    assert two["steps"] == one["steps"] == len(batches)
    assert two["trained_tokens_this_run"] == one["trained_tokens_this_run"]
    assert [r["step"] for r in two["curve"]] == [r["step"] for r in one["curve"]]
    for a, b in zip(one["curve"], two["curve"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["acc_0"] == pytest.approx(b["acc_0"], abs=1e-6)
    _assert_same_weights(_final_state(spec["run_dir"]), _final_state(two_spec["run_dir"]))
    assert load_export(Path(two_spec["export_dir"]), Path(spec["target_weights"])).config.draft_vocab_size == 40
    assert "resuming" not in log.read_text()


def test_kill_9_of_a_two_process_run_then_resume_ends_where_an_unbroken_run_does(tmp_path: Path) -> None:
    spec = random_store_train_spec(tmp_path, **{**SETTINGS, "max_steps": 15})
    spec_file = _write(tmp_path, spec, "spec")
    process = _torchrun(spec_file, tmp_path / "first.log")
    killed_after = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        found = latest_checkpoint(Path(spec["run_dir"]))
        if found is not None and int(found.name.split("-")[1]) >= 6:
            os.killpg(process.pid, signal.SIGKILL)  # torchrun and both ranks
            killed_after = int(found.name.split("-")[1])
            break
        time.sleep(0.05)
    process.wait(timeout=60)
    assert killed_after is not None, (tmp_path / "first.log").read_text()[-3000:]
    deadline = time.monotonic() + 30
    while _ranks_of(spec_file) and time.monotonic() < deadline:  # the ranks die with their launcher
        time.sleep(0.1)
    assert not _ranks_of(spec_file)
    last = latest_checkpoint(Path(spec["run_dir"]))
    assert last is not None
    last_step = int(last.name.split("-")[1])
    shutil.copytree(spec["run_dir"], tmp_path / "one" / "run")  # the same checkpoint, resumed by one process below

    resumed = _torchrun(spec_file, tmp_path / "second.log")
    assert resumed.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-3000:]
    second = _metadata(tmp_path / "second.log")
    assert second["resumed_from_step"] == last_step >= killed_after
    assert f"resuming from step-{last_step:08d}" in (tmp_path / "second.log").read_text()

    unbroken = run(_elsewhere(spec, tmp_path / "unbroken"), Recorder())
    print(
        f"\n-- killed after step {killed_after}, resumed from {last_step}; {second['steps']} steps, "
        f"last loss {second['last_loss']:.5f} (unbroken {unbroken['last_loss']:.5f})"
    )
    assert second["steps"] == unbroken["steps"] > last_step
    assert second["last_loss"] == pytest.approx(unbroken["last_loss"], rel=1e-4)
    _assert_same_weights(_final_state(spec["run_dir"]), _final_state(str(tmp_path / "unbroken" / "run")))

    report = Recorder()
    one = run(_elsewhere(spec, tmp_path / "one"), report)  # another number of processes: the data position holds
    assert one["resumed_from_step"] == last_step and one["steps"] == unbroken["steps"]
    assert report.lines[0].endswith("1 process (the checkpoint was written by a run of 2 processes)")
    _assert_same_weights(_final_state(str(tmp_path / "one" / "run")), _final_state(str(tmp_path / "unbroken" / "run")))
