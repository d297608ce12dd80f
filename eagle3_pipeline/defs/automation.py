"""What runs by itself: the scheduled backfill of `responses`, and declarative automation downstream.
Both are automation conditions, evaluated by one sensor, `pipeline_automation` (running by default).

- The scheduled backfill (only when the pipeline file sets `schedule.cron`; setting the cron is the
  opt-in). `responses` and `prompts` declare :func:`scheduled_backfill`: at the first evaluation
  after each cron tick, the partitions that are not in a run or backfill already and that the
  launch decision (:func:`eagle3_pipeline.orchestration.launch.decide_generation`, the one the
  `inference_health` sensor asks too) takes — missing or stale, the health gate passing, neither
  backing off nor given up after failures, at most one per free healthy host — are requested. The
  sensor emits one Dagster backfill for all of them (one run when a single partition is due); with
  several inference hosts each run claims its host when it starts
  (:mod:`eagle3_pipeline.orchestration.hosts`). When the gate is closed, the tick's log says why and
  nothing is requested until the next cron tick. Partitions are the file's dataset ids, so a dataset
  added to the file is a new partition the next tick backfills.
- Everything downstream of `responses` follows: each phase declares :data:`FOLLOW_UPSTREAM`. A
  downstream phase reads *all* partitions of its input, so it waits until none is missing or in
  progress, then runs once per change upstream — what a sensor would have to hand-code with cursors.

The sensor runs in the code server (`use_user_code_server=True`), as Dagster requires for a
condition written in Python (:class:`GenerationDue`), which reads the settings at evaluation time
from the `pipeline` resource. The cron itself is part of the graph's shape: read when the code
location loads.
"""

from __future__ import annotations

import datetime
import warnings

import dagster as dg

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.defs.resources import PipelineResource
from eagle3_pipeline.orchestration.hosts import sick_hosts_line
from eagle3_pipeline.orchestration.launch import ALL_CURRENT, decide_generation

AUTOMATION_SENSOR = "pipeline_automation"
AUTOMATION_INTERVAL_S = 30

# The condition every phase downstream of `responses` declares: run when an input changed (or the
# phase was never materialized), once no input partition is missing or being materialized. Not with
# `all_deps_blocking_checks_passed()`: it waits on every blocking check of every input, WARN ones
# included (hidden_states' serving_agreement fails as WARN when nothing was validated); each phase
# names the checks it refuses on itself (eagle3_pipeline.orchestration.gating).
FOLLOW_UPSTREAM = dg.AutomationCondition.eager()


class GenerationDue(dg.AutomationCondition):
    """True for the dataset partitions to (re)generate now: `responses` is missing or stale, every
    required health check passes (on at least one host, and then no more partitions than free
    healthy hosts), and the partition is neither backing off nor given up after failed runs
    (:func:`eagle3_pipeline.orchestration.launch.decide_generation`). Decided once per evaluation
    (shared by `prompts` and `responses`), with the settings of the `pipeline` resource at that
    moment; the reasons go to the sensor tick's log."""

    def __init__(self, pipeline: PipelineResource) -> None:
        self.pipeline = pipeline
        self._decided: tuple[datetime.datetime, frozenset[str]] | None = None

    @property
    def description(self) -> str:
        return "missing or stale responses, the health gate passes, not backing off or left alone after failures"

    def get_label(self) -> str | None:
        return "generation due"

    def evaluate(self, context: dg.AutomationContext) -> dg.AutomationResult:
        if context.candidate_subset.is_empty:
            return dg.AutomationResult(context=context, true_subset=context.candidate_subset)
        due = self._due(context)
        return dg.AutomationResult(
            context=context, true_subset=context.candidate_subset.compute_intersection_with_partition_keys(due)
        )

    def _due(self, context: dg.AutomationContext) -> frozenset[str]:
        if self._decided is not None and self._decided[0] == context.evaluation_time:
            return self._decided[1]
        decision = decide_generation(context.asset_graph_view.instance, self.pipeline.config(), context.log.warning)
        due = decision.due
        if not decision.gate_open:
            context.log.warning(f"not backfilling responses: {decision.gate}")
        else:
            sick = sick_hosts_line(decision.verdicts)
            if sick:
                context.log.warning(sick)
            if due:
                context.log.info(
                    "backfilling responses: " + ", ".join(f"{p} ({decision.wanted[p]})" for p in sorted(due))
                )
            if decision.plan is not None and decision.plan.reasons():
                context.log.warning(f"not backfilling: {decision.plan.reasons()}")
            elif not due:
                context.log.info(ALL_CURRENT)
        self._decided = (context.evaluation_time, due)
        return due


def scheduled_backfill(config: PipelineConfig, pipeline: PipelineResource) -> dg.AutomationCondition | None:
    """The condition of `responses` and `prompts`, or None when `schedule.cron` is not set."""
    settings = config.schedule
    if settings.cron is None:
        return None
    return (
        dg.AutomationCondition.cron_tick_passed(settings.cron, settings.timezone)
        & ~dg.AutomationCondition.in_progress()
        & GenerationDue(pipeline)
    ).with_label(f"scheduled backfill ({settings.cron} {settings.timezone})")


def build_automation_sensor() -> dg.AutomationConditionSensorDefinition:
    # `use_user_code_server` is a Beta parameter, and a condition written in Python (GenerationDue)
    # needs it: its BetaWarning is expected here, so it is silenced for this one call only.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*use_user_code_server.*", category=dg.BetaWarning)
        return dg.AutomationConditionSensorDefinition(
            AUTOMATION_SENSOR,
            target=dg.AssetSelection.all(),
            default_status=dg.DefaultSensorStatus.RUNNING,
            minimum_interval_seconds=AUTOMATION_INTERVAL_S,
            emit_backfills=True,
            use_user_code_server=True,
            description="Evaluates the automation conditions: the scheduled backfill of `responses` (when the "
            "pipeline file sets schedule.cron) and the phases that follow it.",
        )
