"""What runs by itself: the scheduled backfill of `responses`, and declarative automation downstream.

- `responses_backfill` (only when the pipeline file sets `schedule.cron`; then it starts running —
  setting the cron is the opt-in): on each tick, behind the health gate, one `generation_job` run
  per missing or stale `responses` partition, with the run keys, backoff and give-up of
  :mod:`eagle3_pipeline.defs.launching` (with several inference hosts: on the healthy ones, one run
  per host). Partitions are the file's dataset ids, so a dataset added
  to the file is a new partition the next tick backfills.
- Everything downstream of `responses` follows by declarative automation: each phase declares
  :data:`FOLLOW_UPSTREAM` (an `AutomationCondition`), and the `pipeline_automation` sensor
  (running by default) evaluates them. A downstream phase reads *all* partitions of its input,
  so it waits until none is missing or in progress, then runs once per change upstream — what a
  sensor would have to hand-code with cursors.
"""

from __future__ import annotations

import dagster as dg

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.defs.hosts import InferenceHosts, gate_summary, sick_hosts_line
from eagle3_pipeline.defs.launching import plan_launches
from eagle3_pipeline.defs.staleness import partitions_to_generate

AUTOMATION_SENSOR = "pipeline_automation"
AUTOMATION_INTERVAL_S = 30

# The condition every phase downstream of `responses` declares: run when an input changed (or the
# phase was never materialized), once no input partition is missing or being materialized.
FOLLOW_UPSTREAM = dg.AutomationCondition.eager()


def build_backfill_schedule(config: PipelineConfig, generation_job: str) -> list[dg.ScheduleDefinition]:
    """The scheduled backfill, or nothing when `schedule.cron` is not set."""
    settings = config.schedule
    if settings.cron is None:
        return []
    hosts = InferenceHosts(config)

    @dg.schedule(
        name="responses_backfill",
        cron_schedule=settings.cron,
        execution_timezone=settings.timezone,
        job_name=generation_job,
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Backfills the missing or stale `responses` partitions (one generation_job run "
        "each) while the health gate passes; failed partitions are retried with backoff, then left alone.",
    )
    def responses_backfill(context: dg.ScheduleEvaluationContext) -> list[dg.RunRequest] | dg.SkipReason:
        verdicts, _ = hosts.tick()
        if not any(v.report.healthy for v in verdicts):
            return dg.SkipReason(f"not launching generation: {gate_summary(verdicts)}")
        wanted = partitions_to_generate(context.instance, config)
        plan = plan_launches(
            context.instance,
            generation_job,
            list(wanted),
            config.launch,
            tags={"eagle3/launched_by": "responses_backfill"},
            hosts=hosts.choice(verdicts),
        )
        if sick_hosts_line(verdicts):
            context.log.info(sick_hosts_line(verdicts))
        if plan.requests:
            context.log.info("launching " + ", ".join(f"{r.partition_key} ({wanted[r.partition_key or '']})" for r in plan.requests))
            if plan.reasons():
                context.log.info(plan.reasons())
            return plan.requests
        return dg.SkipReason(plan.reasons() or "every responses partition is materialized and current")

    return [responses_backfill]


def build_automation_sensor() -> dg.AutomationConditionSensorDefinition:
    return dg.AutomationConditionSensorDefinition(
        AUTOMATION_SENSOR,
        target=dg.AssetSelection.all(),
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=AUTOMATION_INTERVAL_S,
        description="Evaluates the automation conditions of the phases downstream of `responses`.",
    )
