"""The main job end to end: `eagle3-pipeline run` as a real process on a real Dagster instance.

The first test is the suite's one end-to-end run of the main job on the real embedded model (SmolLM2-135M-Instruct,
the stand-in for the target), on a tiny slice (two datasets of three prompts, two training steps), in the fast
tier: the command on a terminal (its progress bar and summary), every phase, the rerun that does nothing, the
recorded runs re-executable as the UI would. The other tests need a server slow enough to kill mid-generation
on demand, or one that records no serving reference, so they point the pipeline at a scripted
OpenAI-compatible server on loopback instead.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import MAIN_PATH
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply, echo_completion
from eagle3_pipeline_tests.cli_runs import run_on_a_terminal
from eagle3_pipeline_tests.locations import location_file

pytestmark = [pytest.mark.e2e, pytest.mark.local_model]

CLI = [sys.executable, "-m", "eagle3_pipeline.cli"]


def run_cli(config: Path, home: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    return subprocess.run(
        [*CLI, "run", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=config.parent,
    )


def checkpoint_ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if line.endswith("}")]


def open_instance(home: Path, monkeypatch: pytest.MonkeyPatch) -> dg.DagsterInstance:
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return dg.DagsterInstance.from_config(str(home))


def test_main_job_on_the_embedded_server(tmp_path: Path, local_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("a", "b"):
        write_jsonl(tmp_path / f"{name}.jsonl", [sharegpt(f"Say the word {name} {i}.") for i in range(3)])
    config = tmp_path / "pipeline.yaml"
    config.write_text(
        "name: e2e\nartifacts_root: out\ntarget: {model: SmolLM2-135M-Instruct}\n"
        # A snapshot every 0.05 s: several bars while the real model answers.
        "generation: {max_tokens: 8, concurrency: 4, progress_interval_s: 0.05}\nhealth: {max_truncation_rate: 1.0}\n"
        # Six samples: half of them held out, so drafter_eval has an eval split; two training steps.
        "training_data: {eval_fraction: 0.5}\ndrafter: {ttt_steps: 2, max_steps: 2, batch_tokens: 512}\n"
        "datasets:\n  - {id: B1, source: a.jsonl}\n  - {id: B2, source: b.jsonl}\n"
    )
    home = tmp_path / "home"

    # On a terminal: the progress bar is drawn from the progress the asset bodies report to the CLI's listener.
    code, screen = run_on_a_terminal(
        [*CLI, "run", "--config", str(config)], tmp_path, {**os.environ, "DAGSTER_HOME": str(home)}, timeout=600
    )
    stderr = (tmp_path / "stderr.txt").read_text()
    assert code == 0, screen[-3000:] + stderr[-3000:]
    bars = [frame for frame in screen.split("\r") if frame.startswith("B1 [")]
    assert len(bars) >= 2, screen
    assert "/3  " in bars[0] and "tok/s" in bars[0] and "ETA" in bars[0]
    assert any(frame.startswith("B1 [" + "#" * 28 + "] 3/3") for frame in bars), "the final snapshot fills the bar"
    assert "» generation_job [B1]" in screen and "» downstream_job" in screen
    assert "training_data: 6 rows" in screen
    # Every phase ran here, the Pipes steps (target_model, the heavy phases) included: none warns.
    assert not re.findall(r"\w+Warning: .*", stderr), "a normal run prints no Python warning"
    out = tmp_path / "out"
    assert len(checkpoint_ids(out / "responses" / "B1.checkpoint.jsonl")) == 3
    assert (out / "training_data" / "manifest.json").exists()
    assert "hidden_states: 6 samples" in screen and "bytes/token (formula 4613)" in screen
    assert (out / "hidden_states" / "index.parquet").exists() and (out / "draft_vocab" / "vocab.safetensors").exists()
    assert "eagle3_drafter: " in screen and (out / "drafter" / "export" / "config.json").exists()
    assert "acceptance length τ on the eval split" in screen and "| all |" in screen
    assert not (out / "logs" / "embedded-server.log").read_text().count("Traceback")

    log_size = (out / "logs" / "embedded-server.log").stat().st_size
    second = run_cli(config, home)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (out / "logs" / "embedded-server.log").stat().st_size == log_size, (
        "no server is started when nothing is left"
    )
    assert [line.split()[3] for line in second.stdout.splitlines() if line.startswith("B")] == ["0", "0"]
    assert "0 shards written" in second.stdout, "a rerun keeps every finished hidden-state shard"

    instance = open_instance(home, monkeypatch)
    for partition in ("B1", "B2"):
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("responses"), asset_partitions=[partition]), limit=5
        ).records
        assert len(records) == 2, "one materialization per run of the main job"
        assert all(r.asset_materialization and r.asset_materialization.metadata["rows"].value == 3 for r in records)
    assert instance.get_latest_materialization_event(dg.AssetKey("training_data")) is not None
    servers = subprocess.run(
        ["pgrep", "-f", "eagle3_pipeline.inference.embedded"], capture_output=True, text=True
    ).stdout.split()
    ours = [pid for pid in servers if Path(f"/proc/{pid}/cwd").resolve() == tmp_path.resolve()]
    assert not ours, "the embedded server stops with the run (servers of other work on this machine aside)"

    runs = instance.get_runs()
    assert {run.job_name for run in runs} == set(MAIN_PATH), "the code location's own jobs, no ad-hoc ones"
    partitions = sorted(run.tags["dagster/partition"] for run in runs if run.job_name == "generation_job")
    assert partitions == ["B1", "B1", "B2", "B2"], "generation_job once per partition in each run"
    assert all(run.status == dg.DagsterRunStatus.SUCCESS for run in runs)
    [evaluated] = instance.fetch_materializations(dg.AssetKey("drafter_eval"), limit=1).records
    assert evaluated.asset_materialization is not None
    scaling = str(evaluated.asset_materialization.metadata["data_scaling"].value)
    # τ at the first eval depth of a two-step drafter (K = 2); one checkpoint is too few points for a fit.
    assert scaling.startswith("τ@2 against the training tokens seen") and "too few points" in scaling, scaling

    # As the UI would: the job rebuilt from a code location of the same pipeline file, re-executing a step of the
    # recorded run (its inputs read back from that run; each step is a subprocess here, so one step, not all).
    monkeypatch.chdir(tmp_path)
    location_file(tmp_path, config).write_text(
        location_file(tmp_path, config).read_text()
        + "\n\ndef downstream_job():\n    return defs.resolve_job_def('downstream_job')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    location = importlib.import_module("location")
    downstream = [run for run in runs if run.job_name == "downstream_job"][-1]  # the first run's (newest first)
    again = dg.execute_job(
        dg.reconstructable(location.downstream_job),
        instance=instance,
        reexecution_options=dg.ReexecutionOptions(parent_run_id=downstream.run_id, step_selection=["drafter_eval"]),
    )
    assert again.success, "re-executable as the UI would, from the recorded run"
    assert [event.step_key for event in again.get_step_success_events()] == ["drafter_eval"]


@pytest.mark.slow
def test_killed_mid_generation_resumes_without_loss_or_duplicates(
    tmp_path: Path, local_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs killed mid-generation, then a run that fails in eagle3_drafter (its folder is a file), then one
    that finishes: no answer is lost or written twice. The failed run's output names eagle3_drafter as the
    cause and hidden_states' serving_agreement, failed as WARN (the scripted server records no serving
    reference), as context, without a traceback; it is the same main job as the resumed one, so the failure
    costs no run of its own."""
    server = FakeOpenAI(delay_s=0.15).start()
    try:
        prompts = [sharegpt(f"Prompt number {i}") for i in range(40)]
        write_jsonl(tmp_path / "p.jsonl", prompts)
        config = tmp_path / "pipeline.yaml"
        config.write_text(
            f"name: kill\nartifacts_root: out\ntarget: {{model: fake, tokenizer: {local_model}}}\n"
            f"inference: {{kind: endpoints, endpoints: [{{base_url: '{server.base_url}'}}]}}\n"
            "generation: {max_tokens: 8, concurrency: 3}\nhealth: {max_truncation_rate: 1.0}\n"
            # 40 samples at the default 5 % may leave no eval row, and drafter_eval needs one.
            "training_data: {eval_fraction: 0.2}\n"
            # Two drafter steps: the default is a production recipe (10 epochs), and this test is about generation.
            "drafter: {ttt_steps: 2, max_steps: 2, batch_tokens: 512}\n"
            "datasets:\n  - {id: B1, source: p.jsonl}\n"
        )
        home = tmp_path / "home"
        checkpoint = tmp_path / "out" / "responses" / "B1.checkpoint.jsonl"
        env = {**os.environ, "DAGSTER_HOME": str(home)}
        kept: list[str] = []
        for target in (6, 18):
            proc = subprocess.Popen(
                [*CLI, "run", "--config", str(config)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 600  # the CLI's start-up, minutes on a loaded machine
            while len(checkpoint_ids(checkpoint)) < target and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            now = checkpoint_ids(checkpoint)
            assert now[: len(kept)] == kept, "finished responses were lost or rewritten"
            assert 0 < len(now) < len(prompts), "the kill did not land mid-generation"
            kept = now

        drafter_folder = tmp_path / "out" / "drafter"
        drafter_folder.write_text("a file where the drafter's folder goes\n")
        failed = run_cli(config, home, timeout=900)
        assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
        assert "marked run" in failed.stdout, "the killed runs are reported and their pool slots freed"
        error = failed.stderr[failed.stderr.index("eagle3-pipeline: run") :]
        print(f"\nthe CLI's error:\n{error}")
        summary = error.splitlines()
        assert re.fullmatch(r"eagle3-pipeline: run \S+ of downstream_job failed: step eagle3_drafter: .+", summary[0])
        assert "drafter" in summary[0] and "serving_agreement" not in summary[0], summary[0]
        assert summary[1] == "  also failed, without stopping the run: check serving_agreement on hidden_states (WARN)"
        assert summary[2].startswith("  error, traceback and logs: run ")
        assert "Traceback" not in failed.stderr and "Stack Trace" not in failed.stderr, failed.stderr[-4000:]

        drafter_folder.unlink()
        final = run_cli(config, home, timeout=900)
        assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-3000:]
        ids = checkpoint_ids(checkpoint)
        assert len(ids) == len(set(ids)) == len(prompts)
        assert ids[: len(kept)] == kept
        # The validation's reference requests (POST /generate, no max_tokens) are not generation requests.
        generation_requests = [r for r in server.requests if r.get("max_tokens") == 8]
        assert len(generation_requests) <= len(prompts) + 2 * 3, "at most the requests in flight are sent again"
        instance = open_instance(home, monkeypatch)
        failures = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE]))
        assert [run.job_name for run in failures] == ["downstream_job", "generation_job", "generation_job"]
    finally:
        server.stop()


def test_a_failed_blocking_check_stops_the_main_job_with_its_verdict(tmp_path: Path) -> None:
    server = FakeOpenAI(script=lambda body, n: Reply(payload=echo_completion(body, finish_reason="length"))).start()
    try:
        write_jsonl(tmp_path / "p.jsonl", [sharegpt(f"Prompt number {i}") for i in range(4)])
        config = tmp_path / "pipeline.yaml"
        config.write_text(
            "name: trunc\nartifacts_root: out\ntarget: {model: fake, tokenizer: unused}\n"
            f"inference: {{kind: endpoints, endpoints: [{{base_url: '{server.base_url}'}}]}}\n"
            "generation: {length_estimator: chars}\nhealth: {max_truncation_rate: 0.5}\n"
            "datasets:\n  - {id: B1, source: p.jsonl}\n"
        )
        result = run_cli(config, tmp_path / "home", timeout=120)
        assert result.returncode == 1
        assert "check truncation_rate on responses: 4 of 4 truncated (100%; limit 50%)" in result.stderr
        assert "» generation_job [B1]" in result.stdout and "downstream_job" not in result.stdout
    finally:
        server.stop()
