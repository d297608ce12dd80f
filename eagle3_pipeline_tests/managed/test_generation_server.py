"""The managed generation server in the Dagster layer, on a real temporary instance, with the SGLang stand-in
of conftest as the engine (no SGLang engine, no GPU on this machine; over SSH, the scripted nvidia-smi):

- a `responses` run starts the server it needs (an event on the run and an observation of `inference_server`),
  its preflight sees it, and it is left running; a finished partition contacts no server;
- a server that keeps dying mid-generation fails the run after the bounded restarts, with the log's tail, and
  alerts a loopback webhook;
- the `inference_health` gate: a stopped managed server does not block the launch (the run starts it), a
  running but sick one does, and so does a failing or UNKNOWN check of the host."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import GENERATION_JOB, build_definitions
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.hosts import build_host
from eagle3_pipeline.managed import ManagedServer, managed_server, open_supervisor
from eagle3_pipeline.managed.launch import ServerPurpose
from eagle3_pipeline.orchestration.generation_decision import decide_generation
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd, healthy_gpu_rows
from eagle3_pipeline.testing.webhook import Receiver
from eagle3_pipeline_tests.dagster_runs import evaluate_sensor
from eagle3_pipeline_tests.managed.pipelines import fake_sglang_serving, ssh_health
from eagle3_pipeline_tests.pipeline_files import load_pipeline

PROMPTS = 12
URL_VAR = "EAGLE3_TEST_ALERT_URL"


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """These tests start `python -m sglang.launch_server` stand-ins, which the health tests look for."""


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as test_instance:
        yield test_instance


def pipeline(
    tmp_path: Path, scenario: dict[str, Any] | None = None, health: dict[str, Any] | None = None, **sections: Any
) -> PipelineConfig:
    """A managed stand-in server and one dataset B1 of PROMPTS prompts."""
    serving = fake_sglang_serving(tmp_path, **sections.pop("serving", {}))
    Path(serving["env"]["FAKE_SGLANG_SCENARIO"]).write_text(json.dumps(scenario or {}))
    write_jsonl(tmp_path / "p.jsonl", [sharegpt(f"question {i}") for i in range(PROMPTS)])
    return load_pipeline(
        tmp_path,
        {
            "serving": serving,
            # Two at a time: the stand-in's listen backlog (5) holds them all, so none of a dead server's
            # connection attempts reaches the next one by a SYN retransmitted a second later.
            "generation": {
                "length_estimator": "chars",
                "max_tokens": 8,
                "retry": {"max_attempts": 1},
                "concurrency": {"short": 2, "long": 1},
            },
            "health": {"max_truncation_rate": 1.0, **(health or {})},
            "datasets": [{"id": "B1", "source": "p.jsonl"}],
            **sections,
        },
    )


def server(config: PipelineConfig) -> ManagedServer:
    setup = managed_server(config)
    assert setup is not None
    return ManagedServer(build_host(setup.host), setup)


def generate(config: PipelineConfig, instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    job = build_definitions(config).resolve_job_def(GENERATION_JOB)
    return job.execute_in_process(partition_key="B1", instance=instance, raise_on_error=False)


def server_observations(instance: dg.DagsterInstance) -> list[dict[str, Any]]:
    """The `inference_server` observations, oldest first."""
    records = instance.fetch_observations(dg.AssetKey("inference_server"), limit=50).records
    found = [{k: v.value for k, v in o.metadata.items()} for r in records if (o := r.asset_observation) is not None]
    return found[::-1]


def test_responses_starts_the_managed_server_it_needs_and_leaves_it_running(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    config = pipeline(tmp_path)
    managed = server(config)
    assert managed.status().state == "absent"
    try:
        result = generate(config, instance)
        assert result.success
        status = managed.status()
        assert status.state == "running" and status.record is not None and status.record.role == "generation"
        logged = [m.user_message for m in instance.all_logs(result.run_id) if "managed server" in m.user_message]
        assert len(logged) == 1 and logged[0].startswith("managed server serving (generation) started in ")
        assert logged[0].endswith(": responses B1")
        seen = server_observations(instance)
        [event] = [o for o in seen if "event" in o]
        assert (event["event"], event["role"], event["reason"], event["pid"]) == (
            "started",
            "generation",
            "responses B1",
            status.record.pid,
        )
        assert event["duration_s"] > 0 and "--port" in event["command"]
        preflight = [o for o in seen if "healthy" in o]
        assert preflight and preflight[-1]["healthy"] is True, "the preflight sees the server the run started"
        [materialization] = result.asset_materializations_for_node("responses")
        assert materialization.metadata["rows"].value == PROMPTS
        assert materialization.metadata["server_restarts"].value == 0

        managed.stop("the GPUs are needed elsewhere")
        again = generate(config, instance)
        assert again.success and managed.status().state == "absent", "a finished partition starts no server"
        assert len([o for o in server_observations(instance) if "event" in o]) == 1
    finally:
        managed.stop("test over")
        managed.host.close()


def test_a_server_that_keeps_dying_fails_the_run_with_its_log_tail_and_an_alert(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver = Receiver("server-lost")
    monkeypatch.setenv(URL_VAR, receiver.url)
    config = pipeline(
        tmp_path,
        {"crash_after": 4},
        serving={"max_restarts": 1, "restart_backoff_s": 0},
        alerts={"webhook_url_env": URL_VAR},
    )
    managed = server(config)
    try:
        result = generate(config, instance)
    finally:
        managed.stop("test over")
        managed.host.close()
        receiver.stop()
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    error = failure.step_failure_data.user_failure_data
    assert error is not None and error.description is not None
    message = error.description
    print(f"\n{message}")
    assert message.startswith("B1: the managed server serving (localhost) failed again after 1 restart(s)")
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in message
    assert error.metadata["server_restarts"].value == 1
    [alert] = receiver.bodies
    assert alert["kind"] == "server_lost" and alert["report"] == message
    events = [o["event"] for o in server_observations(instance) if "event" in o]
    assert events == ["started", "failed", "started", "failed"]


def gate(config: PipelineConfig, instance: dg.DagsterInstance) -> Any:
    return evaluate_sensor(build_definitions(config), "inference_health", instance)


def test_a_stopped_managed_server_does_not_block_the_launch_a_sick_one_does(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    config = pipeline(tmp_path)
    decision = decide_generation(instance, config, print)
    assert decision.gate_open and decision.due == {"B1"}
    assert decision.gate.startswith("managed server serving not running (no pid file at ")
    assert decision.gate.endswith("), which a run starts") and decision.notes.startswith(decision.gate)
    stopped = gate(config, instance)
    assert [r.partition_key for r in stopped.run_requests or []] == ["B1"]
    [observed] = [{k: v.value for k, v in e.metadata.items()} for e in stopped.asset_events]
    assert observed["healthy"] is False and observed["check/server_process"] == "critical", "observed as it is"

    with open_supervisor(config) as supervisor:
        assert supervisor is not None
        supervisor.ensure(ServerPurpose.generation(needs_tools=False), "test")
        scenario = Path(config.serving.env["FAKE_SGLANG_SCENARIO"])
        scenario.write_text(json.dumps({"generate": "error"}))
        try:
            sick = gate(config, instance)
        finally:
            supervisor.release("test over")
    assert not sick.run_requests
    assert "not launching generation" in (sick.skip_message or "") and "generation critical" in sick.skip_message

    full_disk = pipeline(tmp_path / "full", health={"min_disk_free_gb": 1e9})
    blocked = gate(full_disk, instance)
    assert not blocked.run_requests and "disk critical" in (blocked.skip_message or "")


def test_the_gate_over_ssh_opens_for_a_stopped_server_but_not_on_an_unknown_check(
    tmp_path: Path, instance: dg.DagsterInstance, sshd: Sshd, fakebin: FakeBin
) -> None:
    fakebin.reset()
    fakebin.set_gpus(healthy_gpu_rows(2))
    health = ssh_health(sshd, expected_gpus=2, shell_section_timeout_s=1)
    config = pipeline(tmp_path, health=health)
    opened = gate(config, instance)
    assert [r.partition_key for r in opened.run_requests or []] == ["B1"]

    fakebin.set_mode("hang")
    try:
        unknown = gate(config, instance)
    finally:
        fakebin.reset()
    assert not unknown.run_requests and "gpus unknown" in (unknown.skip_message or "")
