"""`eagle3-pipeline run` executes the code location's own jobs as ordinary runs, and draws its
progress bar on a terminal from the run's progress observations in the event log.

The CLI runs as a real process on a pseudo-terminal against the scripted OpenAI-compatible server
on loopback (slow enough for several progress snapshots); the tokenizer is the tiny real model's.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.reconstruct import ReconstructableRepository

from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline_tests.conftest import sharegpt, write_jsonl

pytestmark = [pytest.mark.local_model]


def run_on_a_terminal(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    parent, child = pty.openpty()
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=child, stderr=(cwd / "stderr.txt").open("wb")
    )
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(parent, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(parent)
    return proc.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_run_executes_the_named_jobs_and_draws_progress_from_the_event_log(
    tmp_path: Path, local_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = FakeOpenAI(delay_s=0.1).start()
    try:
        write_jsonl(tmp_path / "p.jsonl", [sharegpt(f"Prompt number {i}") for i in range(30)])
        config = tmp_path / "pipeline.yaml"
        config.write_text(
            json.dumps(
                {
                    "name": "cli",
                    "artifacts_root": "out",
                    "target": {"model": "fake", "tokenizer": str(local_model)},
                    "inference": {"kind": "endpoints", "endpoints": [{"base_url": server.base_url}]},
                    "generation": {"max_tokens": 8, "concurrency": 2, "progress_interval_s": 0.3},
                    "health": {"max_truncation_rate": 1.0, "min_disk_free_gb": 0.01, "min_mem_free_gb": 0.01},
                    "training_data": {"eval_fraction": 0.2},  # 30 samples at 5 % may leave no eval row for drafter_eval
                    "drafter": {"epochs": 1},  # the production default (10) is no test's business here
                    "datasets": [{"id": "B1", "source": "p.jsonl"}],
                }
            )
        )
        home = tmp_path / "home"
        env = {**os.environ, "DAGSTER_HOME": str(home)}
        code, screen = run_on_a_terminal(
            [sys.executable, "-m", "eagle3_pipeline.cli", "run", "--config", str(config)], tmp_path, env, timeout=300
        )
    finally:
        server.stop()
    assert code == 0, screen[-3000:] + (tmp_path / "stderr.txt").read_text()[-3000:]
    bars = [frame for frame in screen.split("\r") if frame.startswith("B1 [")]
    assert len(bars) >= 2, screen
    assert "/30  " in bars[0] and "tok/s" in bars[0] and "ETA" in bars[0]
    assert any(frame.startswith("B1 [" + "#" * 28 + "] 30/30") for frame in bars), "the final snapshot fills the bar"
    assert "» generation_job [B1]" in screen and "» downstream_job" in screen and "training_data: 30 rows" in screen

    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("EAGLE3_CONFIG", str(config))
    monkeypatch.chdir(tmp_path)
    instance = dg.DagsterInstance.get()
    runs = {run.job_name: run for run in instance.get_runs()}
    assert set(runs) == {"generation_job", "downstream_job"}, "the code location's own jobs, no ad-hoc ones"
    assert runs["generation_job"].tags["dagster/partition"] == "B1"
    assert all(run.status == dg.DagsterRunStatus.SUCCESS for run in runs.values())
    [evaluated] = instance.fetch_materializations(dg.AssetKey("drafter_eval"), limit=1).records
    scaling = evaluated.asset_materialization.metadata["data_scaling"].value  # type: ignore[union-attr]
    assert scaling.startswith("τ@3 against the training tokens seen") and "too few points" in scaling, scaling

    repository = ReconstructableRepository.for_module(
        "eagle3_pipeline.definitions", "defs", working_directory=str(tmp_path)
    )
    again = dg.execute_job(
        repository.get_reconstructable_job("downstream_job"),
        instance=instance,
        reexecution_options=dg.ReexecutionOptions(parent_run_id=runs["downstream_job"].run_id),
    )
    assert again.success, "re-executable as the UI would, from the recorded run"
