"""The health gate of every inference host, as the `inference_health` sensor and the
`responses_backfill` schedule tick it.

Without `inference.hosts` there is one implicit host: the pipeline's `health` section, observed on
`inference_server`, and runs carry no host tag — as before several hosts existed. With
`inference.hosts`, each host's gate runs on its own health section (concurrently, so a slow host does
not hold up the others' verdicts), is observed on `inference_server/<name>` once per tick, and only
the healthy hosts receive partitions (see :func:`eagle3_pipeline.defs.launching.plan_launches`).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.defs.launching import HostChoice, LaunchHost
from eagle3_pipeline.health import HealthReport, TickState
from eagle3_pipeline.monitor import HealthMonitor


@dataclass(frozen=True)
class HostVerdict:
    """One host's report of one tick (`name` None: the single implicit host)."""

    name: str | None
    report: HealthReport

    @property
    def line(self) -> str:
        return self.report.summary() if self.name is None else f"host {self.name}: {self.report.summary()}"


class InferenceHosts:
    """One :class:`HealthMonitor` per host, each keeping its connection across ticks."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        names: list[str | None] = [host.name for host in config.inference.hosts] or [None]
        self.monitors = {name: HealthMonitor(config.for_host(name)) for name in names}

    @property
    def several(self) -> bool:
        return bool(self.config.inference.hosts)

    def tick(self, cursor: str | None = None) -> tuple[list[HostVerdict], str]:
        """Every host's report, and the cursor for the next tick (one host's TickState as before,
        or ``{"hosts": {name: TickState}}``)."""
        if not self.several:
            report, state = self.monitors[None].tick(TickState.from_json(cursor))
            return [HostVerdict(None, report)], state.to_json()
        previous = _host_states(cursor)

        def one(name: str | None) -> tuple[HealthReport, TickState]:
            return self.monitors[name].tick(TickState.from_json(previous.get(str(name))))

        with ThreadPoolExecutor(max_workers=len(self.monitors)) as pool:
            results = dict(zip(self.monitors, pool.map(one, self.monitors), strict=True))
        verdicts = [HostVerdict(name, report) for name, (report, _) in results.items()]
        states = {str(name): state.to_json() for name, (_, state) in results.items()}
        return verdicts, json.dumps({"hosts": states}, sort_keys=True)

    def choice(self, verdicts: list[HostVerdict]) -> HostChoice | None:
        """The healthy hosts to place partitions on (None with the single implicit host)."""
        if not self.several:
            return None
        healthy = {v.name for v in verdicts if v.report.healthy}
        return HostChoice(
            healthy=[LaunchHost(h.name, h.pool_name) for h in self.config.inference.hosts if h.name in healthy],
            unhealthy=frozenset(h.name for h in self.config.inference.hosts if h.name not in healthy),
            untagged=self.config.inference.host(None).name,
        )


def _host_states(cursor: str | None) -> dict[str, str]:
    """host → its TickState JSON from a cursor; an empty, unreadable or single-host one starts afresh."""
    try:
        states = json.loads(cursor or "{}").get("hosts")
    except (ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in states.items()} if isinstance(states, dict) else {}


def gate_summary(verdicts: list[HostVerdict]) -> str:
    return "; ".join(v.line for v in verdicts)


def sick_hosts_line(verdicts: list[HostVerdict]) -> str:
    """Why the unhealthy ones of several hosts get no new partition ("" when all are healthy)."""
    sick = [v.line for v in verdicts if v.name is not None and not v.report.healthy]
    return "no new partitions for " + "; ".join(sick) if sick else ""
