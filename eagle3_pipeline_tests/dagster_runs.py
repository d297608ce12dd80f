"""Driving and reading real Dagster runs in the tests (a helper module, not a test): assets materialized
outside their Definitions, a sensor ticked and its runs executed without the daemon, the automation
conditions evaluated at a time, a run's log lines, check results and materializations, a stalled
generation run; and the pipeline file those tests orchestrate (:func:`write_pipeline`)."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

import dagster as dg

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation.heartbeat import HeartbeatWriter, heartbeat_path
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline_tests.pipeline_files import write_sources


def pipeline_resources(config_path: Path) -> dict[str, object]:
    """The `pipeline` resource (and no phase listener), for assets materialized outside their Definitions."""
    from eagle3_pipeline.components.resources import PipelineResource
    from eagle3_pipeline.results import NO_LISTENER

    return {"pipeline": PipelineResource(config_path=str(config_path)), "phase_listener": NO_LISTENER}


def materialize(
    assets: list[Any], selection: list[str], config: PipelineConfig
) -> tuple[dg.DagsterInstance, dg.ExecuteInProcessResult]:
    instance = dg.DagsterInstance.ephemeral()
    return instance, dg.materialize(
        assets, selection=selection, instance=instance, resources=pipeline_resources(config.source_file)
    )


def run_log(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    return [entry.user_message for entry in instance.all_logs(run_id)]


def checks(result: dg.ExecuteInProcessResult) -> dict[str, tuple[bool, str]]:
    return {e.check_name: (e.passed, e.severity.value) for e in result.get_asset_check_evaluations()}


def start_stalled_generation(defs: dg.Definitions, instance: dg.DagsterInstance, artifacts_root: Path) -> dg.DagsterRun:
    """A started `generation_job` run of B1 whose runner heartbeat is alive but whose checkpoint has
    not grown for an hour: what `generation_stall` must flag once the stall window (1 s) has passed."""
    run = instance.create_run_for_job(
        defs.resolve_job_def("generation_job"), tags={"dagster/partition": "B1"}, status=dg.DagsterRunStatus.STARTED
    )
    checkpoint = artifacts_root / "responses" / "B1.checkpoint.jsonl"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text('{"id": "x"}\n')
    os.utime(checkpoint, (time.time() - 3600, time.time() - 3600))
    HeartbeatWriter(heartbeat_path(artifacts_root, "B1"), run.run_id).start()
    time.sleep(1.5)
    return run


def materialize_generation(
    config: PipelineConfig, instance: dg.DagsterInstance, partition: str = "B1"
) -> dg.ExecuteInJobResult:
    """prompts and responses of one dataset's partition, through the pipeline's own Definitions."""
    defs = build_definitions(config)
    assets: Any = list(defs.assets or [])
    return dg.materialize(
        assets,
        selection=["prompts", "responses"],
        partition_key=partition,
        instance=instance,
        resources=defs.resources,
        raise_on_error=False,
    )


def failure_description(result: dg.ExecuteInJobResult) -> str:
    """The description of the run's one failed step, raised as a ``dg.Failure``."""
    [failure] = [e for e in result.all_events if e.is_step_failure]
    data = failure.step_failure_data
    assert data.user_failure_data is not None and data.user_failure_data.description
    return data.user_failure_data.description


def sensor_resources(defs: dg.Definitions, sensor: dg.SensorDefinition) -> dict[str, Any]:
    """The Definitions' resources that the sensor requires, as the code server builds them for a tick."""
    return {key: value for key, value in (defs.resources or {}).items() if key in sensor.required_resource_keys}


class Daemonless:
    """Ticks a sensor and executes the runs it requests, with the tags the sensor daemon adds."""

    def __init__(self, defs: dg.Definitions, instance: dg.DagsterInstance, sensor: str = "inference_health") -> None:
        self.defs = defs
        self.instance = instance
        self.sensor = defs.resolve_sensor_def(sensor)
        self.cursor: str | None = None
        self.launched: list[str] = []

    def tick(self) -> Any:
        context = dg.build_sensor_context(
            instance=self.instance,
            cursor=self.cursor,
            definitions=self.defs,
            resources=sensor_resources(self.defs, self.sensor),
        )
        result = self.sensor.evaluate_tick(context)
        self.cursor = result.cursor
        for request in result.run_requests or []:
            run_key, job_name = request.run_key, self.sensor.job_name
            assert run_key is not None and job_name is not None, "the sensor names its job and each run's key"
            assert run_key not in self.launched, "a run key is launched once"
            self.launched.append(run_key)
            self.defs.resolve_job_def(job_name).execute_in_process(
                partition_key=request.partition_key,
                instance=self.instance,
                tags={**request.tags, "dagster/run_key": run_key, "dagster/sensor_name": self.sensor.name},
                raise_on_error=False,
            )
        return result


def evaluate_sensor(defs: dg.Definitions, name: str, instance: dg.DagsterInstance, cursor: str | None = None) -> Any:
    """One tick of the sensor ``name`` on ``instance``, with the resources its definition asks for."""
    sensor = defs.resolve_sensor_def(name)
    context = dg.build_sensor_context(
        instance=instance, cursor=cursor, definitions=defs, resources=sensor_resources(defs, sensor)
    )
    return sensor.evaluate_tick(context)


def evaluate_at(defs: dg.Definitions, instance: dg.DagsterInstance, when: datetime.datetime, cursor: Any = None) -> Any:
    """One evaluation of the automation conditions, as the `pipeline_automation` sensor makes it at `when`."""
    return dg.evaluate_automation_conditions(defs=defs, instance=instance, evaluation_time=when, cursor=cursor)


def requested(result: Any, key: str) -> list[str]:
    return sorted(result.get_requested_partitions(dg.AssetKey(key)))


def materialized(instance: dg.DagsterInstance, key: str) -> list[dg.EventLogRecord]:
    return list(instance.fetch_materializations(dg.AssetKey(key), limit=100).records)


def fake_server_sections(
    folder: Path, server: FakeOpenAI, datasets: tuple[str, ...] = ("B1", "B2"), without_source: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Pipeline sections for generation against the fake OpenAI server, and three-prompt sources for
    ``datasets`` (but ``without_source``), for :func:`~eagle3_pipeline_tests.pipeline_files.write_pipeline`."""
    write_sources(folder, *(name for name in datasets if name not in without_source))
    return {
        "name": "orchestrated",
        "target": {"model": "fake", "tokenizer": "unused"},
        "inference": {"kind": "endpoints", "endpoints": [{"base_url": server.base_url}]},
        "generation": {"max_tokens": 8, "concurrency": 2, "length_estimator": "chars"},  # the fake has no tokenizer
        "health": {"host": {"kind": "local"}},
        "datasets": [{"id": name, "source": f"{name}.jsonl"} for name in datasets],
    }
