"""kill -9 of a managed real vLLM (CPU build, the embedded model) mid-generation: the `responses` run of
`generation_job` on a real temporary Dagster instance starts the server (no server before), the test kills
the server's whole process group (its pgid from the pid file) once some answers are written, and the run
detects it, restarts the server and finishes the partition: one restart (event and duration on the run and
on `inference_server`, the record in the responses metadata), 0 answers lost, 0 written twice; the server is
left running, and a final stop (verified) leaves no process of either server.

Sized for CI: 40 chat prompts, 32 tokens each, 4 at a time; two server starts of ~20 s each on two quiet cores.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import GENERATION_JOB, build_definitions
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation import ResponseCheckpoint
from eagle3_pipeline.hosts import LocalHost
from eagle3_pipeline.managed import ManagedServer, managed_server
from eagle3_pipeline.records import read_prompts
from eagle3_pipeline.testing.process_groups import processes_of
from eagle3_pipeline.testing.real_vllm import free_port, managed_serving
from eagle3_pipeline_tests.pipeline_files import load_pipeline

pytestmark = [pytest.mark.local_model, pytest.mark.timeout(900)]

SAMPLES = Path(__file__).resolve().parents[2] / "eagle3_pipeline" / "samples"
PROMPTS = 40
KILL_AT = 8  # answers written before the kill


def pipeline(folder: Path, python: Path, model: Path) -> PipelineConfig:
    sections = {
        "name": "recovery_vllm",
        "target": {"model": "smol", "tokenizer": str(model), "max_seq_len": 2048},
        "serving": managed_serving(
            python, model, free_port(), folder / "logs", bind_host="127.0.0.1", max_restarts=2, restart_backoff_s=1
        ),
        "generation": {
            "max_tokens": 32,
            "temperature": 0.0,
            "concurrency": {"short": 4, "long": 2},
            "length_estimator": "chars",
            "retry": {"max_attempts": 2},
        },
        "health": {"generation_timeout_s": 30, "max_truncation_rate": 1.0},
        "datasets": [{"id": "B1", "source": str(SAMPLES / "chat.jsonl"), "sample_size": PROMPTS}],
    }
    return load_pipeline(folder, sections)


def answered(checkpoint: Path) -> list[str]:
    """The ids of the checkpoint's complete lines, in file order."""
    if not checkpoint.exists():
        return []
    data = checkpoint.read_bytes()
    return [json.loads(line)["id"] for line in data[: data.rfind(b"\n") + 1].splitlines()]


def test_kill_9_of_the_managed_vllm_mid_generation(real_vllm_python: Path, local_model: Path, tmp_path: Path) -> None:
    config = pipeline(tmp_path, real_vllm_python, local_model)
    setup = managed_server(config)
    assert setup is not None
    server = ManagedServer(LocalHost(), setup)
    assert server.status().state == "absent", "no server before the run"
    checkpoint = tmp_path / "out" / "responses" / "B1.checkpoint.jsonl"
    killed: dict[str, Any] = {}

    def kill_mid_generation() -> None:
        while len(answered(checkpoint)) < KILL_AT:
            time.sleep(0.05)
        record = json.loads(Path(setup.serving.pid_path).read_text())
        killed.update(pgid=record["pgid"], rows_before=len(answered(checkpoint)), at=time.monotonic())
        os.killpg(record["pgid"], signal.SIGKILL)

    killer = threading.Thread(target=kill_mid_generation, daemon=True)
    killer.start()
    started = time.monotonic()
    with dg.instance_for_test() as instance:
        job = build_definitions(config).resolve_job_def(GENERATION_JOB)
        try:
            result = job.execute_in_process(partition_key="B1", instance=instance, raise_on_error=False)
            finished = time.monotonic()
            status = server.status()
        finally:
            stopped = server.stop("test over")
        records = instance.fetch_observations(dg.AssetKey("inference_server"), limit=50).records
        seen: list[dict[str, Any]] = [
            {k: v.value for k, v in o.metadata.items()} for r in records if (o := r.asset_observation)
        ][::-1]
        logged = [m.user_message for m in instance.all_logs(result.run_id) if "managed server" in m.user_message]
    killer.join(timeout=1)
    assert result.success, [e.message for e in result.all_events if e.is_step_failure]
    assert killed, "the kill happened"

    [materialization] = result.asset_materializations_for_node("responses")
    metadata: dict[str, Any] = {key: value.value for key, value in materialization.metadata.items()}
    events = [o for o in seen if "event" in o]
    ids = answered(checkpoint)
    prompt_ids = {p.id for p in read_prompts(tmp_path / "out" / "prompts" / "B1.parquet")}
    figures = {
        "restarts": metadata["server_restarts"],
        "restart": metadata["restarts"],
        "rows_before_kill": killed["rows_before"],
        "rows_after": len(ids),
        "prompts": len(prompt_ids),
        "lost": len(prompt_ids - set(ids)),
        "duplicated": len(ids) - len(set(ids)),
        "resent_after_restart": metadata["requests_resent_after_restart"],
        "kill_to_end_s": round(finished - killed["at"], 1),
        "run_s": round(finished - started, 1),
        "events": [(e["event"], e["reason"], e["duration_s"]) for e in events],
        "final_stop": stopped.as_metadata(),
    }
    print("\nkill -9 figures: " + json.dumps(figures, indent=1))
    print("\n".join(logged))

    assert metadata["server_restarts"] == 1 and metadata["failed"] == 0 and metadata["rows"] == PROMPTS
    [restart] = metadata["restarts"]
    assert restart["outcome"] == "serving" and restart["duration_s"] > 0 and restart["backoff_s"] == 1
    assert restart["reason"].startswith(("died: ", "orphaned: ", "hung: "))
    assert KILL_AT <= killed["rows_before"] < PROMPTS, "the kill landed mid-generation"
    assert len(ids) == len(set(ids)) == PROMPTS and set(ids) == prompt_ids, "0 lost, 0 duplicated"
    assert set(ResponseCheckpoint(checkpoint).load()) == prompt_ids
    actions = [e["event"] for e in events]
    assert actions[0] == "started" and actions[1] == "failed" and actions[-1] == "started"
    assert "restart 1 of at most 2" in events[-1]["reason"] and events[-1]["duration_s"] > 0
    assert any(line.startswith("managed server serving (generation) failed: responses B1: ") for line in logged)
    assert status.state == "running", "the generation server is left running for the next partition"
    assert stopped.verified and processes_of(killed["pgid"]) == [] and processes_of(stopped.pid or 0) == []
