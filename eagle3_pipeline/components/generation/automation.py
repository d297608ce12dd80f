"""The scheduled backfill of `responses` (only when the pipeline file sets `schedule.cron`; setting
the cron is the opt-in): an automation condition that `responses` and `prompts` declare, evaluated
by the `pipeline_automation` sensor (:mod:`eagle3_pipeline.components.execution.automation`).

At the first evaluation after each cron tick, the partitions that are not in a run or backfill
already and that the launch decision takes (:func:`eagle3_pipeline.orchestration.generation_decision.decide_generation`,
the one the `inference_health` sensor asks too: missing or stale, the health gate passing, neither
backing off nor given up after failures, at most one per free healthy host) are requested. The
sensor emits one Dagster backfill for all of them (one run when a single partition is due); with
several inference hosts each run claims its host when it starts
(:mod:`eagle3_pipeline.orchestration.hosts`). When the gate is closed, the tick's log says why and
nothing is requested until the next cron tick. Partitions are the file's dataset ids, so a dataset
added to the file is a new partition the next tick backfills. The condition reads the settings at
evaluation time from the `pipeline` resource; the cron itself is part of the graph's shape, read
when the code location loads.
"""

from __future__ import annotations

import datetime

import dagster as dg

from eagle3_pipeline.components.resources import PipelineResource
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.orchestration.generation_decision import ALL_CURRENT, decide_generation
from eagle3_pipeline.orchestration.hosts import sick_hosts_line


class GenerationDue(dg.AutomationCondition):
    """True for the dataset partitions to (re)generate now: `responses` is missing or stale, every
    required health check passes (on at least one host, and then no more partitions than free
    healthy hosts), and the partition is neither backing off nor given up after failed runs
    (:func:`eagle3_pipeline.orchestration.generation_decision.decide_generation`). Decided once per evaluation
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
        decision = decide_generation(
            context.asset_graph_view.instance, self.pipeline.config(), context.log.warning, names=self.pipeline.names()
        )
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
            if decision.launches is not None and decision.launches.reasons():
                context.log.warning(f"not backfilling: {decision.launches.reasons()}")
            elif not due:
                context.log.info(ALL_CURRENT)
        self._decided = (context.evaluation_time, due)
        return due


def scheduled_backfill(loaded: PipelineConfig, pipeline: PipelineResource) -> dg.AutomationCondition | None:
    """The condition of `responses` and `prompts`, or None when the file as loaded sets no `schedule.cron`."""
    settings = loaded.schedule
    if settings.cron is None:
        return None
    return (
        dg.AutomationCondition.cron_tick_passed(settings.cron, settings.timezone)
        & ~dg.AutomationCondition.in_progress()
        & GenerationDue(pipeline)
    ).with_label(f"scheduled backfill ({settings.cron} {settings.timezone})")
