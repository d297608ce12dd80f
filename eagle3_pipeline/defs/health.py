"""Health in the UI: the inference server as an observed asset, the health sensor that gates
generation runs on it, and the stall sensor that watches running generations."""

import time
from collections.abc import Sequence
from typing import Any

import dagster as dg

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.health import HealthReport, TickState
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.monitor import HealthMonitor, report_markdown, tokens_per_second

INFERENCE_SERVER = dg.AssetKey("inference_server")
RESPONSES = dg.AssetKey("responses")
IN_PROGRESS = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]
PARTITION_TAG = "dagster/partition"

inference_server = dg.AssetSpec(
    INFERENCE_SERVER,
    group_name="target",
    description="The inference host and server. Not materialized: each health tick records an "
    "observation carrying the report (per-check status, GPU table, tokens/s).",
)


def report_metadata(report: HealthReport) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "overall": report.overall.value,
        "healthy": report.healthy,
        "summary": report.summary(),
        "report": dg.MetadataValue.md(report_markdown(report)),
    }
    metadata.update({f"check/{c.name}": c.status.value for c in report.checks})
    rate = tokens_per_second(report)
    if rate is not None:
        metadata["tokens_per_s"] = round(rate, 1)
    return metadata


def health_observation(report: HealthReport) -> dg.AssetObservation:
    return dg.AssetObservation(asset_key=INFERENCE_SERVER, metadata=report_metadata(report))


def partitions_in_progress(instance: dg.DagsterInstance) -> dict[str, str]:
    """partition → run id, for every unfinished run that targets a partition."""
    runs = instance.get_runs(dg.RunsFilter(statuses=IN_PROGRESS))
    return {run.tags[PARTITION_TAG]: run.run_id for run in runs if PARTITION_TAG in run.tags}


def missing_partitions(instance: dg.DagsterInstance, partition_keys: Sequence[str]) -> list[str]:
    done = instance.get_materialized_partitions(RESPONSES)
    busy = partitions_in_progress(instance)
    return [key for key in partition_keys if key not in done and key not in busy]


def build_health_sensors(config: PipelineConfig, generation_job: str) -> list[dg.SensorDefinition]:
    monitor = HealthMonitor(config)
    layout = ArtifactLayout(config.artifacts_root)
    settings = config.health

    @dg.sensor(
        name="inference_health",
        job_name=generation_job,
        minimum_interval_seconds=settings.sensor_interval_s,
        description="Runs the health checks each tick, records them on `inference_server`, and "
        "launches runs for missing `responses` partitions only while every required check passes.",
    )
    def inference_health(context: dg.SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
        report, state = monitor.tick(TickState.from_json(context.cursor))
        context.update_cursor(state.to_json())
        context.instance.report_runless_asset_event(health_observation(report))
        if not report.healthy:
            return dg.SkipReason(f"not launching generation: {report.summary()}")
        missing = missing_partitions(context.instance, config.dataset_ids)
        if not missing:
            return dg.SkipReason(f"{report.summary()}; every responses partition is materialized or running")
        return dg.SensorResult(run_requests=[dg.RunRequest(partition_key=key) for key in missing])

    @dg.sensor(
        name="generation_stall",
        minimum_interval_seconds=max(30, int(settings.stall_window_s // 4)),
        description="Flags a running generation whose checkpoint has not grown within the stall "
        "window (an observation on `responses`), and terminates it if configured.",
    )
    def generation_stall(context: dg.SensorEvaluationContext) -> dg.SkipReason:
        now = time.time()
        stalled = []
        for partition, run_id in partitions_in_progress(context.instance).items():
            if partition not in config.dataset_ids:
                continue
            record = context.instance.get_run_record_by_id(run_id)
            if record is None:
                continue
            started = record.start_time or record.create_timestamp.timestamp()
            checkpoint = layout.checkpoint(partition)
            last = max(started, checkpoint.stat().st_mtime if checkpoint.exists() else 0.0)
            quiet = now - last
            if quiet <= settings.stall_window_s:
                continue
            terminated = settings.terminate_stalled_runs and context.instance.run_launcher.terminate(run_id)
            context.instance.report_runless_asset_event(
                dg.AssetObservation(
                    asset_key=RESPONSES,
                    partition=partition,
                    metadata={"stalled": True, "seconds_without_progress": round(quiet), "run_id": run_id, "terminated": terminated},
                )
            )
            stalled.append(f"{partition} (run {run_id[:8]}, no new response for {quiet:.0f} s{', terminated' if terminated else ''})")
        if stalled:
            return dg.SkipReason("stalled: " + "; ".join(stalled))
        return dg.SkipReason("every running generation made progress within the stall window")

    return [inference_health, generation_stall]
