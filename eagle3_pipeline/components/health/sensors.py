"""Health in the UI: the health sensor that gates generation runs on the inference servers (observed
on them, :mod:`.inference_server`), and the stall sensor that watches running generations.

Default states: `inference_health` starts stopped (it launches work continuously; the scheduled
backfill is the default way to launch, turn the sensor on instead of or beside it); `generation_stall`
starts running (it only observes, and terminates only with `health.terminate_stalled_runs`).

Each sensor's body is the module function named after it; the factory binds the pipeline's names to it
(a sensor's context does not say which pipeline it belongs to) and decorates it."""

from functools import partial

import dagster as dg

from eagle3_pipeline.components.health.inference_server import health_observation
from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.health.alerts import Alerter, stall_detected
from eagle3_pipeline.hidden_states.sharding import extraction_quiet_seconds
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.orchestration.generation_decision import decide_generation
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames
from eagle3_pipeline.orchestration.partition_runs import partitions_in_flight
from eagle3_pipeline.orchestration.stall import extracting_runs, quiet_seconds


def inference_health(context: dg.SensorEvaluationContext, names: PipelineNames) -> dg.SensorResult:
    """The `inference_health` sensor of the pipeline named by `names`: one tick."""
    decision = decide_generation(
        context.instance,
        StepResources(context, names).config(),
        context.log.warning,
        cursor=context.cursor,
        tags={"eagle3/launched_by": "inference_health"},
        names=names,
    )
    events = [health_observation(v.report, v.name, names) for v in decision.verdicts]
    if not decision.gate_open:
        return dg.SensorResult(
            skip_reason=f"not launching generation: {decision.gate}", cursor=decision.cursor, asset_events=events
        )
    if decision.notes:
        context.log.info(decision.notes)
    if decision.launches is None or not decision.launches.requests:
        return dg.SensorResult(
            skip_reason=f"{decision.gate}; {decision.why_nothing}", cursor=decision.cursor, asset_events=events
        )
    return dg.SensorResult(run_requests=decision.launches.requests, cursor=decision.cursor, asset_events=events)


def _flag_stall(
    context: dg.SensorEvaluationContext,
    alerter: Alerter,
    *,
    subject: str,
    run_id: str,
    quiet: float,
    what: str,
    terminate: bool,
) -> tuple[dict[str, bool | int | str], str]:
    """A stalled run (`subject`: its partition, or `hidden_states`), terminated when `terminate`: its
    observation's metadata and its line in the tick's skip reason, alerted."""
    terminated = terminate and context.instance.run_launcher.terminate(run_id)
    metadata = {"stalled": True, "seconds_without_progress": round(quiet), "run_id": run_id, "terminated": terminated}
    line = f"{subject} (run {run_id[:8]}, no {what} for {quiet:.0f} s{', terminated' if terminated else ''})"
    stall_detected(alerter, subject, run_id, line)
    return metadata, line


def generation_stall(context: dg.SensorEvaluationContext, names: PipelineNames) -> dg.SensorResult:
    """The `generation_stall` sensor of the pipeline named by `names`: one tick."""
    config = StepResources(context, names).config()
    stall = config.health
    stalled, events = [], []
    alerter = Alerter.for_pipeline(config, context.log.warning)
    for partition, run_id in partitions_in_flight(context.instance, names).items():
        if partition not in config.dataset_ids:
            continue
        quiet = quiet_seconds(config.artifacts_root, partition, run_id)
        if quiet is None or quiet <= stall.stall_window_s:
            continue
        metadata, line = _flag_stall(
            context,
            alerter,
            subject=partition,
            run_id=run_id,
            quiet=quiet,
            what="new response",
            terminate=stall.terminate_stalled_runs,
        )
        events.append(dg.AssetObservation(asset_key=names.key("responses"), partition=partition, metadata=metadata))
        stalled.append(line)
    for record in extracting_runs(context.instance, names) if config.compute.kind == "local" else []:
        quiet = extraction_quiet_seconds(ArtifactLayout(config.artifacts_root).hidden_states, record.start_time or 0.0)
        if quiet is None or quiet <= stall.stall_window_s:
            continue
        run_id = record.dagster_run.run_id
        metadata, line = _flag_stall(
            context,
            alerter,
            subject="hidden_states",
            run_id=run_id,
            quiet=quiet,
            what="shard written",
            terminate=stall.terminate_stalled_runs,
        )
        events.append(dg.AssetObservation(asset_key=names.key("hidden_states"), metadata=metadata))
        stalled.append(line)
    if stalled:
        return dg.SensorResult(skip_reason="stalled: " + "; ".join(stalled), asset_events=events)
    return dg.SensorResult(skip_reason="every generating or extracting run made progress within the stall window")


def build_health_sensors(loaded: PipelineConfig, names: PipelineNames = DEFAULT_NAMES) -> list[dg.SensorDefinition]:
    """The two sensors of the pipeline named by `names`: `loaded` (the file as loaded) sets the tick
    intervals; each tick reads its settings from the pipeline's settings resource (key `names.pipeline`)."""
    intervals = loaded.health
    inference_health_sensor = dg.sensor(
        name=names.name("inference_health"),
        job_name=names.generation_job,
        required_resource_keys={names.pipeline},
        minimum_interval_seconds=intervals.sensor_interval_s,
        default_status=dg.DefaultSensorStatus.STOPPED,
        description="Runs the health checks each tick, records them on `inference_server` (one "
        "observation per tick; per host on `inference_server/<name>` with several hosts), and launches "
        "runs for missing or stale `responses` partitions only while every required check passes (on a "
        "healthy host, one run per host), or while a managed server is merely stopped (the run starts it); "
        "failed partitions are retried with backoff, then left alone.",
    )(partial(inference_health, names=names))
    generation_stall_sensor = dg.sensor(
        name=names.name("generation_stall"),
        required_resource_keys={names.pipeline},
        minimum_interval_seconds=max(30, int(intervals.stall_window_s // 4)),
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Flags a running generation whose checkpoint has not grown within the stall "
        "window since it started generating (an observation on `responses`), and a running hidden-state "
        "extraction (compute: local) that wrote no shard within the window since it assigned its rows to "
        "shards (an observation on `hidden_states`); terminates them if configured. Runs waiting for the `gpu` "
        "pool, a server start or the target's weights are not working yet.",
    )(partial(generation_stall, names=names))

    return [inference_health_sensor, generation_stall_sensor]
