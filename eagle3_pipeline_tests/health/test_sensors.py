"""The Dagster layer of health: the gate sensor, the stall sensor and the preflight, against the
real sshd on loopback, the fake SGLang process tree and a scripted nvidia-smi (this machine has no
GPU), on a real ephemeral Dagster instance."""

from __future__ import annotations

import os
import time
from pathlib import Path

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.generation.heartbeat import HeartbeatWriter, heartbeat_path
from eagle3_pipeline.health.gate import HealthMonitor, UnhealthyError
from eagle3_pipeline.testing.fake_sglang import FakeSglang
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd, TcpProxy, healthy_gpu_rows
from eagle3_pipeline_tests.dagster_runs import evaluate_sensor, start_stalled_generation
from eagle3_pipeline_tests.health.pipeline_files import sensed_sections
from eagle3_pipeline_tests.pipeline_files import load_pipeline


def observations(instance: dg.DagsterInstance, key: str) -> list[dict]:
    records = instance.fetch_observations(dg.AssetKey(key), limit=10).records
    return [{k: v.value for k, v in o.metadata.items()} for r in records if (o := r.asset_observation) is not None]


@pytest.fixture
def instance():
    with dg.instance_for_test() as test_instance:
        yield test_instance


def test_sensor_launches_nothing_while_a_check_is_critical(
    tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin, instance: dg.DagsterInstance
) -> None:
    sglang.start()
    gpus.set_gpus(healthy_gpu_rows(7))
    defs = build_definitions(load_pipeline(tmp_path, sensed_sections(tmp_path, sshd, sglang), runtime_checks=True))
    result = evaluate_sensor(defs, "inference_health", instance)
    assert not result.run_requests
    skipped = result.skip_message or ""
    assert "not launching generation" in skipped and "gpus critical" in skipped
    [seen] = [{k: v.value for k, v in e.metadata.items()} for e in result.asset_events]
    assert seen["healthy"] is False and seen["check/gpus"] == "critical"


def test_sensor_launches_nothing_while_a_check_is_unknown(
    tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin, instance: dg.DagsterInstance
) -> None:
    sglang.start()
    gpus.set_mode("hang")
    defs = build_definitions(
        load_pipeline(
            tmp_path,
            sensed_sections(tmp_path, sshd, sglang),
            {"health": {"shell_section_timeout_s": 1}},
            runtime_checks=True,
        )
    )
    result = evaluate_sensor(defs, "inference_health", instance)
    assert not result.run_requests and "gpus unknown" in (result.skip_message or "")


@pytest.mark.slow
def test_sensor_launches_missing_partitions_once_healthy(
    tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin, instance: dg.DagsterInstance
) -> None:
    sglang.start()
    config = load_pipeline(tmp_path, sensed_sections(tmp_path, sshd, sglang), runtime_checks=True)
    defs = build_definitions(config)
    result = evaluate_sensor(defs, "inference_health", instance)
    assert sorted(str(r.partition_key) for r in result.run_requests or []) == ["B1", "B2"]
    assert [e.metadata["healthy"].value for e in result.asset_events] == [True]

    job = defs.resolve_job_def("generation_job")
    assert job.execute_in_process(partition_key="B1", instance=instance).success
    again = evaluate_sensor(defs, "inference_health", instance, cursor=result.cursor)
    assert [r.partition_key for r in again.run_requests or []] == ["B2"]


def test_blocking_checks_fail_a_run_with_too_many_truncated_responses(
    tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin, instance: dg.DagsterInstance
) -> None:
    """The fake server answers every request with finish_reason 'length'."""
    sglang.start()
    defs = build_definitions(
        load_pipeline(
            tmp_path,
            sensed_sections(tmp_path, sshd, sglang),
            {"health": {"max_truncation_rate": 0.5}},
            runtime_checks=True,
        )
    )
    result = defs.resolve_job_def("generation_job").execute_in_process(
        partition_key="B1", instance=instance, raise_on_error=False
    )
    assert not result.success
    checks = {
        e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    }
    assert checks["truncation_rate"].passed is False
    assert checks["truncation_rate"].description == "3 of 3 truncated (100%; limit 50%)"
    assert checks["prompts_accounted"].passed and checks["single_model"].passed and checks["empty_answers"].passed


def test_preflight_fails_fast_on_a_sick_server(
    tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin, instance: dg.DagsterInstance
) -> None:
    """A run started from the UI bypasses the sensor: the asset's own gate refuses it."""
    sglang.start()
    sglang.set(generate="error")
    defs = build_definitions(load_pipeline(tmp_path, sensed_sections(tmp_path, sshd, sglang), runtime_checks=True))
    started = time.monotonic()
    result = defs.resolve_job_def("generation_job").execute_in_process(
        partition_key="B1", instance=instance, raise_on_error=False
    )
    assert not result.success and time.monotonic() - started < 30
    failure = next(e for e in result.all_events if e.is_step_failure)
    error = failure.step_failure_data.error
    assert error is not None and "health gate refused" in error.message and "generation critical" in error.message
    checkpoint = tmp_path / "out" / "responses" / "B1.checkpoint.jsonl"
    assert not checkpoint.exists() or checkpoint.read_text() == "", "no request was answered"
    seen = observations(instance, "inference_server")
    assert seen and seen[0]["healthy"] is False and seen[0]["check/generation"] == "critical"


def test_sensor_tick_against_a_hung_host_returns_within_20_s(
    tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin, instance: dg.DagsterInstance
) -> None:
    proxy = TcpProxy(sshd.port)
    try:
        known = tmp_path / "known_hosts_proxy"
        known.write_text(sshd.known_hosts.read_text().replace(f"]:{sshd.port} ", f"]:{proxy.port} "))
        sglang.start()
        config = load_pipeline(
            tmp_path, sensed_sections(tmp_path, sshd, sglang, port=proxy.port, known_hosts=known), runtime_checks=True
        )
        defs = build_definitions(config)
        assert HealthMonitor(config).preflight()
        proxy.freeze()
        sglang.set(hang_all=True)
        started = time.monotonic()
        result = evaluate_sensor(defs, "inference_health", instance)
        assert time.monotonic() - started < 20
        assert not result.run_requests and "unknown" in (result.skip_message or "")
    finally:
        proxy.close()


def test_stall_sensor_flags_a_generation_that_stopped_writing(
    tmp_path: Path, sshd: Sshd, sglang: FakeSglang, instance: dg.DagsterInstance
) -> None:
    config = load_pipeline(
        tmp_path, sensed_sections(tmp_path, sshd, sglang), {"health": {"stall_window_s": 1}}, runtime_checks=True
    )
    defs = build_definitions(config)
    run = start_stalled_generation(defs, instance, config.artifacts_root)
    result = evaluate_sensor(defs, "generation_stall", instance)
    said = result.skip_message or ""
    assert said.startswith("stalled: B1") and run.run_id[:8] in said
    [flagged] = result.asset_events
    assert flagged.asset_key == dg.AssetKey("responses") and flagged.partition == "B1"
    assert flagged.metadata["stalled"].value is True

    (config.artifacts_root / "responses" / "B1.checkpoint.jsonl").write_text('{"id": "x"}\n{"id": "y"}\n')
    assert "made progress" in (evaluate_sensor(defs, "generation_stall", instance).skip_message or "")


def test_stall_sensor_ignores_runs_that_have_not_started_generating(
    tmp_path: Path, sshd: Sshd, sglang: FakeSglang, instance: dg.DagsterInstance
) -> None:
    """A run waiting for the `gpu` pool or for its server to start has no heartbeat of its own yet:
    however long it waits, it is not stalled (here: an hour-old heartbeat of an earlier run)."""
    config = load_pipeline(
        tmp_path, sensed_sections(tmp_path, sshd, sglang), {"health": {"stall_window_s": 1}}, runtime_checks=True
    )
    defs = build_definitions(config)
    instance.create_run_for_job(
        defs.resolve_job_def("generation_job"), tags={"dagster/partition": "B1"}, status=dg.DagsterRunStatus.STARTED
    )
    earlier = HeartbeatWriter(heartbeat_path(config.artifacts_root, "B1"), "an-earlier-run")
    earlier.start()
    os.utime(heartbeat_path(config.artifacts_root, "B1"), (time.time() - 3600, time.time() - 3600))
    time.sleep(1.5)
    result = evaluate_sensor(defs, "generation_stall", instance)
    assert "made progress" in (result.skip_message or "") and not result.asset_events


def test_unhealthy_error_carries_the_report(tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin) -> None:
    config = load_pipeline(tmp_path, sensed_sections(tmp_path, sshd, sglang), runtime_checks=True)
    with pytest.raises(UnhealthyError) as refused:
        HealthMonitor(config).preflight()
    assert refused.value.report.check("server_process").status.value == "critical"
