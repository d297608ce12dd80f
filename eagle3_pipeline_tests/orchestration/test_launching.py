"""Launching without thrashing, and gating across runs, on a real Dagster instance.

The sensor is evaluated with `build_sensor_context` on a real (temporary) instance, and each run it
requests is executed for real on that instance, as the daemon would launch it. The server is the
scripted OpenAI-compatible server on loopback; the health gate probes this machine.
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import load_config
from eagle3_pipeline.orchestration.generation_decision import decide_generation
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES
from eagle3_pipeline.orchestration.partition_runs import backoff_s, decide_launches
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply, echo_completion
from eagle3_pipeline_tests.dagster_runs import (
    Daemonless,
    evaluate_at,
    fake_server_sections,
    requested,
    sensor_resources,
)
from eagle3_pipeline_tests.pipeline_files import load_pipeline, write_pipeline


@pytest.fixture
def instance():
    with dg.instance_for_test() as test_instance:
        yield test_instance


def test_a_failed_partition_waits_for_its_backoff(
    tmp_path: Path, fake_openai: FakeOpenAI, instance: dg.DagsterInstance
) -> None:
    """B2's source file is missing: its run fails at run time (the code location still loads)."""
    config = load_pipeline(
        tmp_path,
        fake_server_sections(tmp_path, fake_openai, without_source=("B2",)),
        {"launch": {"backoff_initial_s": 600}},
    )
    loop = Daemonless(build_definitions(config), instance)
    first = loop.tick()
    assert sorted(str(r.partition_key) for r in first.run_requests or []) == ["B1", "B2"]
    assert len(first.asset_events) == 1 and first.asset_events[0].asset_key == dg.AssetKey("inference_server")
    second = loop.tick()
    assert "backing off: B2 attempt 2 in" in (second.skip_message or "") and not second.run_requests
    [failed] = instance.get_run_records(dg.RunsFilter(tags={"dagster/partition": "B2"}))
    assert failed.end_time is not None
    assert not decide_launches(
        instance, DEFAULT_NAMES, wanted=["B2"], settings=config.launch, now=failed.end_time + 599
    ).requests
    [request] = decide_launches(
        instance, DEFAULT_NAMES, wanted=["B2"], settings=config.launch, now=failed.end_time + 600
    ).requests
    assert request.run_key == "B2:first:attempt-2"
    assert [backoff_s(k, config.launch) for k in (1, 2, 3, 10)] == [600, 1200, 2400, 21600]


def test_a_partition_that_always_fails_is_launched_at_most_n_times_then_left_alone(
    tmp_path: Path, fake_openai: FakeOpenAI, instance: dg.DagsterInstance
) -> None:
    config = load_pipeline(
        tmp_path,
        fake_server_sections(tmp_path, fake_openai, without_source=("B2",)),
        {"launch": {"max_attempts": 3, "backoff_initial_s": 0}},
    )
    loop = Daemonless(build_definitions(config), instance)
    ticks = [loop.tick() for _ in range(6)]
    assert [k for k in loop.launched if k.startswith("B2")] == [
        "B2:first:attempt-1",
        "B2:first:attempt-2",
        "B2:first:attempt-3",
    ]
    for result in ticks[3:]:
        assert not result.run_requests, "left alone on every later tick"
        assert "left alone: B2 failed 3 times in a row (last: " in result.skip_message
        assert f"{config.source_file}: datasets[1] (id 'B2').source: file" in result.skip_message
        assert "does not exist); re-execute it to try again" in result.skip_message
        assert len(result.asset_events) == 1, "one health observation per tick"
    statuses = [r.status for r in instance.get_runs(dg.RunsFilter(tags={"dagster/partition": "B2"}))]
    assert statuses == [dg.DagsterRunStatus.FAILURE] * 3


def test_a_success_starts_a_new_epoch_of_attempts(
    tmp_path: Path, fake_openai: FakeOpenAI, instance: dg.DagsterInstance
) -> None:
    config = load_pipeline(
        tmp_path,
        fake_server_sections(tmp_path, fake_openai, datasets=("B1",)),
        {"launch": {"max_attempts": 1, "backoff_initial_s": 0}},
    )
    defs = build_definitions(config)
    job = defs.resolve_job_def("generation_job")
    assert job.execute_in_process(partition_key="B1", instance=instance).success
    (tmp_path / "B1.jsonl").unlink()
    assert not job.execute_in_process(partition_key="B1", instance=instance, raise_on_error=False).success
    assert "left alone" in decide_launches(instance, DEFAULT_NAMES, wanted=["B1"], settings=config.launch).reasons()
    write_jsonl(tmp_path / "B1.jsonl", [sharegpt("B1 question 0")])
    assert job.execute_in_process(partition_key="B1", instance=instance).success, "re-executed by hand"
    [request] = decide_launches(instance, DEFAULT_NAMES, wanted=["B1"], settings=config.launch).requests
    success = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.SUCCESS]), limit=1)[0]
    assert request.run_key == f"B1:{success.run_id[:8]}:attempt-1"


# QUEUED is in the same list; a queued run cannot be created without a remote job origin here.
@pytest.mark.parametrize(
    "status", [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]
)
def test_queued_started_and_canceling_runs_are_in_flight(
    tmp_path: Path, fake_openai: FakeOpenAI, instance: dg.DagsterInstance, status: dg.DagsterRunStatus
) -> None:
    """A canceling run still holds the checkpoint lock: no second run may start beside it."""
    defs = build_definitions(load_pipeline(tmp_path, fake_server_sections(tmp_path, fake_openai)))
    run = instance.create_run_for_job(
        defs.resolve_job_def("generation_job"), tags={"dagster/partition": "B1"}, status=status
    )
    result = Daemonless(defs, instance).tick()
    assert [r.partition_key for r in result.run_requests] == ["B2"]
    assert instance.get_runs(dg.RunsFilter(tags={"dagster/partition": "B1"})) == [instance.get_run_by_id(run.run_id)]


@pytest.mark.slow
def test_a_rematerialized_prompts_partition_makes_its_responses_stale(
    tmp_path: Path, fake_openai: FakeOpenAI, instance: dg.DagsterInstance
) -> None:
    defs = build_definitions(load_pipeline(tmp_path, fake_server_sections(tmp_path, fake_openai)))
    loop = Daemonless(defs, instance)
    loop.tick()
    assert "every responses partition is materialized and current" in loop.tick().skip_message
    assert dg.materialize([defs.resolve_assets_def("prompts")], partition_key="B2", instance=instance).success
    assert [r.partition_key for r in loop.tick().run_requests] == ["B2"]


def test_a_dataset_added_to_the_file_is_a_new_partition(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    write_pipeline(tmp_path, fake_server_sections(tmp_path, fake_openai, datasets=("B1", "B2", "B9")))
    config = load_config(tmp_path / "pipeline.yaml", runtime_checks=False)
    graph = build_definitions(config).resolve_asset_graph()
    partitions = graph.get(dg.AssetKey("responses")).partitions_def
    assert partitions is not None and partitions.get_partition_keys() == ["B1", "B2", "B9"]


@pytest.mark.local_model
@pytest.mark.slow
def test_training_data_refuses_a_partition_whose_latest_blocking_check_failed(
    tmp_path: Path, local_model: Path, instance: dg.DagsterInstance
) -> None:
    """B2's answers all stop at max_tokens, so its blocking truncation check fails; a later run of
    training_data (another run, as automation would start it) refuses it until B2 is fixed."""
    truncate = {"B2": True}

    def script(body: dict[str, Any], n: int) -> Reply:
        cut = truncate["B2"] and body["messages"][-1]["content"].startswith("B2")
        return Reply(payload=echo_completion(body, finish_reason="length" if cut else "stop"))

    server = FakeOpenAI(script=script).start()
    try:
        defs = build_definitions(
            load_pipeline(tmp_path, fake_server_sections(tmp_path, server), {"target": {"tokenizer": str(local_model)}})
        )
        generation = defs.resolve_job_def("generation_job")
        assert generation.execute_in_process(partition_key="B1", instance=instance).success
        assert not generation.execute_in_process(partition_key="B2", instance=instance, raise_on_error=False).success

        downstream = defs.resolve_job_def("downstream_job")
        only_training_data = [dg.AssetKey("training_data")]  # six samples are too few for the EAGLE-3 phases
        refused = downstream.execute_in_process(
            instance=instance, asset_selection=only_training_data, raise_on_error=False
        )
        assert not refused.success
        failure = next(e for e in refused.all_events if e.is_step_failure)
        assert failure.step_failure_data.user_failure_data is not None, str(failure.step_failure_data.error)
        message = failure.step_failure_data.user_failure_data.description or ""
        assert "responses[B2]: check truncation_rate failed (3 of 3 truncated (100%; limit 50%))" in message
        assert "B1" not in message
        assert not (tmp_path / "out" / "training_data" / "manifest.json").exists()

        truncate["B2"] = False
        for leftover in (tmp_path / "out" / "responses").glob("B2.*"):
            leftover.unlink()
        assert generation.execute_in_process(partition_key="B2", instance=instance).success, "the rerun fixes B2"
        assert downstream.execute_in_process(instance=instance, asset_selection=only_training_data).success
        assert (tmp_path / "out" / "training_data" / "manifest.json").exists()
    finally:
        server.stop()


@pytest.mark.slow
def test_the_scheduled_backfill_requests_what_is_due_at_each_cron_tick_and_leaves_a_failing_partition_alone(
    tmp_path: Path, fake_openai: FakeOpenAI, instance: dg.DagsterInstance, caplog: pytest.LogCaptureFixture
) -> None:
    """Cron every minute; B2's source file is missing, so each of its runs fails. Ticks are
    evaluation times; the runs a tick requests are executed as the backfill would."""
    caplog.set_level(logging.INFO)
    config = load_pipeline(
        tmp_path,
        fake_server_sections(tmp_path, fake_openai, without_source=("B2",)),
        {"schedule": {"cron": "* * * * *"}, "launch": {"max_attempts": 2, "backoff_initial_s": 0}},
    )
    defs = build_definitions(config)
    job = defs.resolve_job_def("generation_job")
    start = datetime.datetime(2026, 1, 1, 2, 0, 10, tzinfo=datetime.UTC)
    minute = datetime.timedelta(minutes=1)

    result = evaluate_at(defs, instance, start)
    assert result.total_requested == 0, "no cron tick has passed since the first evaluation"
    result = evaluate_at(defs, instance, start + minute / 3, result.cursor)
    assert result.total_requested == 0, "still no cron tick"
    for attempt in (1, 2):
        result = evaluate_at(defs, instance, start + attempt * minute, result.cursor)
        wanted = ["B1", "B2"] if attempt == 1 else ["B2"]
        assert requested(result, "responses") == wanted and requested(result, "prompts") == wanted
        for partition in wanted:
            job.execute_in_process(partition_key=partition, instance=instance, raise_on_error=False)
    caplog.clear()
    for later in (3, 4):
        result = evaluate_at(defs, instance, start + later * minute, result.cursor)
        assert result.total_requested == 0, "left alone after max_attempts failures"
    assert "left alone: B2 failed 2 times in a row (last: " in caplog.text
    assert f"{config.source_file}: datasets[1] (id 'B2').source: file" in caplog.text


def test_the_scheduled_backfill_waits_for_the_health_gate(
    tmp_path: Path, fake_openai: FakeOpenAI, instance: dg.DagsterInstance, caplog: pytest.LogCaptureFixture
) -> None:
    """The endpoint answers every request with HTTP 503: the gate is closed, the tick's log says why."""
    caplog.set_level(logging.INFO)
    fake_openai.script = lambda body, n: Reply(status=503, payload={"error": {"message": "overloaded"}})
    defs = build_definitions(
        load_pipeline(tmp_path, fake_server_sections(tmp_path, fake_openai), {"schedule": {"cron": "* * * * *"}})
    )
    start = datetime.datetime(2026, 1, 1, 2, 0, 10, tzinfo=datetime.UTC)
    result = evaluate_at(defs, instance, start)
    result = evaluate_at(defs, instance, start + datetime.timedelta(minutes=1), result.cursor)
    assert result.total_requested == 0
    assert "not backfilling responses: " in caplog.text


def test_the_sensor_and_the_scheduled_backfill_take_the_one_launch_decision(
    tmp_path: Path, fake_openai: FakeOpenAI, instance: dg.DagsterInstance
) -> None:
    """B1 is materialized, B2 failed (its source file is missing) and backs off, B3 is missing: the
    decision, the sensor's run requests and the scheduled backfill's requests all name B3 alone."""
    config = load_pipeline(
        tmp_path,
        fake_server_sections(tmp_path, fake_openai, datasets=("B1", "B2", "B3"), without_source=("B2",)),
        {"schedule": {"cron": "* * * * *"}, "launch": {"backoff_initial_s": 600}},
    )
    defs = build_definitions(config)
    job = defs.resolve_job_def("generation_job")
    assert job.execute_in_process(partition_key="B1", instance=instance).success
    assert not job.execute_in_process(partition_key="B2", instance=instance, raise_on_error=False).success

    alerts: list[str] = []
    decision = decide_generation(instance, config, alerts.append)
    assert decision.gate_open and decision.due == {"B3"}
    assert dict(decision.wanted) == {"B2": "missing", "B3": "missing"}
    assert "backing off: B2 attempt 2 in" in decision.notes

    sensor = Daemonless(defs, instance).sensor
    context = dg.build_sensor_context(instance=instance, definitions=defs, resources=sensor_resources(defs, sensor))
    requests = sensor.evaluate_tick(context).run_requests
    assert requests is not None and [r.partition_key for r in requests] == ["B3"]

    start = datetime.datetime(2026, 1, 1, 2, 0, 10, tzinfo=datetime.UTC)
    result = evaluate_at(defs, instance, start)
    result = evaluate_at(defs, instance, start + datetime.timedelta(minutes=1), result.cursor)
    assert requested(result, "responses") == ["B3"]
