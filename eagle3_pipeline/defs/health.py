"""Health in the UI: the inference server as an observed asset, the health sensor that gates
generation runs on it, and the stall sensor that watches running generations.

Default states: `inference_health` starts stopped (it launches work continuously; the scheduled
backfill is the default way to launch, turn the sensor on instead of or beside it); `generation_stall`
starts running (it only observes, and terminates only with `health.terminate_stalled_runs`)."""

from typing import Any

import dagster as dg

from eagle3_pipeline.alerts import Alerter, stall_detected
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.defs.resources import PipelineResource
from eagle3_pipeline.health import HealthReport
from eagle3_pipeline.hidden_states.plan import extraction_quiet_seconds
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.monitor import report_markdown, tokens_per_second
from eagle3_pipeline.orchestration.launch import decide_generation
from eagle3_pipeline.orchestration.launching import partitions_in_flight
from eagle3_pipeline.orchestration.stall import extracting_runs, quiet_seconds

INFERENCE_SERVER = dg.AssetKey("inference_server")
RESPONSES = dg.AssetKey("responses")
HIDDEN_STATES = dg.AssetKey("hidden_states")

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


def server_key(host: str | None = None) -> dg.AssetKey:
    """`inference_server`, or `inference_server/<host>` for one of several inference hosts."""
    return INFERENCE_SERVER if host is None else dg.AssetKey([*INFERENCE_SERVER.path, host])


def inference_server_specs(config: PipelineConfig) -> list[dg.AssetSpec]:
    """`inference_server`, and one observed asset per host of `inference.hosts`."""
    return [inference_server] + [
        dg.AssetSpec(
            server_key(host.name),
            group_name="target",
            description=f"Inference host {host.name!r} (pool {host.pool_name}): each health tick records an observation "
            "carrying its report; while it is not healthy it receives no new `responses` partition.",
        )
        for host in config.inference.hosts
    ]


def health_observation(report: HealthReport, host: str | None = None) -> dg.AssetObservation:
    metadata = report_metadata(report) if host is None else {"host": host, **report_metadata(report)}
    return dg.AssetObservation(asset_key=server_key(host), metadata=metadata)


def build_health_sensors(config: PipelineConfig, generation_job: str) -> list[dg.SensorDefinition]:
    """`config` (the file at load) sets the tick intervals; each tick reads its settings from the
    `pipeline` resource."""
    intervals = config.health

    @dg.sensor(
        name="inference_health",
        job_name=generation_job,
        minimum_interval_seconds=intervals.sensor_interval_s,
        default_status=dg.DefaultSensorStatus.STOPPED,
        description="Runs the health checks each tick, records them on `inference_server` (one "
        "observation per tick; per host on `inference_server/<name>` with several hosts), and launches "
        "runs for missing or stale `responses` partitions only while every required check passes (on a "
        "healthy host, one run per host); failed partitions are retried with backoff, then left alone.",
    )
    def inference_health(context: dg.SensorEvaluationContext, pipeline: PipelineResource) -> dg.SensorResult:
        decision = decide_generation(
            context.instance,
            pipeline.config(),
            context.log.warning,
            cursor=context.cursor,
            tags={"eagle3/launched_by": "inference_health"},
        )
        events = [health_observation(v.report, v.name) for v in decision.verdicts]
        if not decision.gate_open:
            return dg.SensorResult(
                skip_reason=f"not launching generation: {decision.gate}", cursor=decision.cursor, asset_events=events
            )
        if decision.notes:
            context.log.info(decision.notes)
        if decision.plan is None or not decision.plan.requests:
            return dg.SensorResult(
                skip_reason=f"{decision.gate}; {decision.why_nothing}", cursor=decision.cursor, asset_events=events
            )
        return dg.SensorResult(run_requests=decision.plan.requests, cursor=decision.cursor, asset_events=events)

    @dg.sensor(
        name="generation_stall",
        minimum_interval_seconds=max(30, int(intervals.stall_window_s // 4)),
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Flags a running generation whose checkpoint has not grown within the stall "
        "window since it started generating (an observation on `responses`), and a running hidden-state "
        "extraction (compute: local) that wrote no shard within the window since it planned its shards "
        "(an observation on `hidden_states`); terminates them if configured. Runs waiting for the `gpu` "
        "pool, a server start or the target's weights are not working yet.",
    )
    def generation_stall(context: dg.SensorEvaluationContext, pipeline: PipelineResource) -> dg.SensorResult:
        config = pipeline.config()
        stall = config.health
        stalled, events = [], []
        alerter = Alerter(config, context.log.warning)
        for partition, run_id in partitions_in_flight(context.instance).items():
            if partition not in config.dataset_ids:
                continue
            quiet = quiet_seconds(config, partition, run_id)
            if quiet is None or quiet <= stall.stall_window_s:
                continue
            terminated = stall.terminate_stalled_runs and context.instance.run_launcher.terminate(run_id)
            events.append(
                dg.AssetObservation(
                    asset_key=RESPONSES,
                    partition=partition,
                    metadata={
                        "stalled": True,
                        "seconds_without_progress": round(quiet),
                        "run_id": run_id,
                        "terminated": terminated,
                    },
                )
            )
            stalled.append(
                f"{partition} (run {run_id[:8]}, no new response for {quiet:.0f} s{', terminated' if terminated else ''})"
            )
            stall_detected(alerter, partition, run_id, stalled[-1])
        for record in extracting_runs(context.instance) if config.compute.kind == "local" else []:
            quiet = extraction_quiet_seconds(
                ArtifactLayout(config.artifacts_root).hidden_states, record.start_time or 0.0
            )
            if quiet is None or quiet <= stall.stall_window_s:
                continue
            run_id = record.dagster_run.run_id
            terminated = stall.terminate_stalled_runs and context.instance.run_launcher.terminate(run_id)
            metadata = {
                "stalled": True,
                "seconds_without_progress": round(quiet),
                "run_id": run_id,
                "terminated": terminated,
            }
            events.append(dg.AssetObservation(asset_key=HIDDEN_STATES, metadata=metadata))
            stalled.append(
                f"hidden_states (run {run_id[:8]}, no shard written for {quiet:.0f} s{', terminated' if terminated else ''})"
            )
            stall_detected(alerter, "hidden_states", run_id, stalled[-1])
        if stalled:
            return dg.SensorResult(skip_reason="stalled: " + "; ".join(stalled), asset_events=events)
        return dg.SensorResult(skip_reason="every generating or extracting run made progress within the stall window")

    return [inference_health, generation_stall]
