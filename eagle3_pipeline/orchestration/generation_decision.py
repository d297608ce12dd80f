"""The one launch decision for generation: which `responses` partitions start now, and on which host.

Both ways generation launches by itself ask :func:`decide_generation`: the `inference_health`
sensor (it turns the decision's run requests into runs) and the scheduled backfill's condition
(:class:`eagle3_pipeline.components.generation.automation.GenerationDue`, which takes their partitions).
One decision is: every host's health tick → an alert on each change of a host's verdict → the
gate (at least one open host: healthy, or with its managed server merely stopped — the run starts
it; a running but sick one blocks) → the partitions to generate (missing or stale,
:mod:`.staleness`) → :func:`.partition_runs.decide_launches` (in flight, backoff, given up, free hosts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import dagster as dg

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.health.alerts import Alerter, health_changed
from eagle3_pipeline.orchestration.hosts import HostVerdict, InferenceHosts, gate_summary, sick_hosts_line
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames
from eagle3_pipeline.orchestration.partition_runs import TickLaunches, decide_launches
from eagle3_pipeline.orchestration.staleness import partitions_to_generate

ALL_CURRENT = "every responses partition is materialized and current"


@dataclass(frozen=True)
class GenerationDecision:
    """One tick's decision: the hosts' verdicts and the cursor for the next tick; with the gate
    open, the partitions wanted (partition → why) and the launches decided for them."""

    verdicts: list[HostVerdict]
    cursor: str
    wanted: Mapping[str, str]
    launches: TickLaunches | None

    @property
    def gate_open(self) -> bool:
        return self.launches is not None

    @property
    def gate(self) -> str:
        """Every host's health summary."""
        return gate_summary(self.verdicts)

    @property
    def due(self) -> frozenset[str]:
        """The partitions to launch now."""
        if self.launches is None:
            return frozenset()
        return frozenset(r.partition_key for r in self.launches.requests if r.partition_key)

    @property
    def notes(self) -> str:
        """Whose managed server a run starts, why the sick hosts get nothing and why the other wanted
        partitions wait ("" if none)."""
        reasons = self.launches.reasons() if self.launches is not None else ""
        stopped = "; ".join(v.line for v in self.verdicts if v.stopped is not None)
        return "; ".join(line for line in (stopped, sick_hosts_line(self.verdicts), reasons) if line)

    @property
    def why_nothing(self) -> str:
        """Why no partition is launched (meaningful when :attr:`due` is empty)."""
        if self.launches is None:
            return f"the health gate is closed: {self.gate}"
        return self.launches.reasons() or ALL_CURRENT


def decide_generation(
    instance: dg.DagsterInstance,
    config: PipelineConfig,
    warn: Callable[[str], None],
    cursor: str | None = None,
    tags: dict[str, str] | None = None,
    names: PipelineNames = DEFAULT_NAMES,
) -> GenerationDecision:
    """Run every host's health tick from `cursor` (alerts on verdict changes go through `warn`),
    then, if one host is healthy, decide the launches of the partitions to generate (their run
    requests carry `tags`), from the records of the pipeline of `names`."""
    hosts = InferenceHosts(config)
    try:
        verdicts, next_cursor = hosts.tick(cursor)
    finally:
        hosts.close()
    for verdict in verdicts:
        alerter = Alerter.for_pipeline(config.for_host(verdict.name), warn)
        health_changed(alerter, verdict.report, verdict.name, verdict.stopped)
    if not any(v.open for v in verdicts):
        return GenerationDecision(verdicts, next_cursor, {}, None)
    wanted = partitions_to_generate(instance, config, names)
    launches = decide_launches(
        instance, names, wanted=list(wanted), settings=config.launch, tags=tags, hosts=hosts.choice(verdicts)
    )
    return GenerationDecision(verdicts, next_cursor, wanted, launches)
