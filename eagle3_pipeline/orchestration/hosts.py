"""The health gate of every inference host, and how a generation run gets its host.

Without `inference.hosts` there is one implicit host: the pipeline's `health` section, observed on
`inference_server`, and runs carry no host tag — as before several hosts existed. With
`inference.hosts`, each host's gate runs on its own health section (concurrently, so a slow host does
not hold up the others' verdicts), is observed on `inference_server/<name>`, and only the healthy
hosts receive partitions.

Placement: the `inference_health` sensor tags each run request with its host (`eagle3/host`) and
pool (`eagle3/pool`). A Dagster backfill — the scheduled one, or one launched from the UI — gives
all its runs the backfill's tags, so it cannot place them in advance: a generation run without a
host tag claims one when it starts (:func:`claim_host`, from the inference resource's setup).
A GPU phase that hands over a host's managed server holds that host the same way for the rest of its
run (:func:`hold_host`), once no other run holds it: no generation run is placed there meanwhile.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import dagster as dg

from eagle3_pipeline.config import InferenceConfig, LaunchConfig, PipelineConfig
from eagle3_pipeline.health import HealthReport, TickState
from eagle3_pipeline.health.gate import HealthMonitor
from eagle3_pipeline.managed import ManagedServer, managed_server, stopped_server
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames
from eagle3_pipeline.orchestration.partition_runs import HostChoice, LaunchHost, claim, hosts_in_flight


class NoHostFree(Exception):
    """No healthy inference host became free within `launch.host_wait_s`."""


@dataclass(frozen=True)
class HostVerdict:
    """One host's report of one tick (`name` None: the single implicit host). `stopped`: the host's
    managed server is stopped and only its own checks fail (:func:`eagle3_pipeline.managed.stopped_server`,
    why): the host is open, since the run that needs the server starts it."""

    name: str | None
    report: HealthReport
    stopped: str | None = None

    @property
    def open(self) -> bool:
        """Whether the host takes generation work: healthy, or its managed server merely stopped."""
        return self.report.healthy or self.stopped is not None

    @property
    def line(self) -> str:
        summary = self.report.summary() if self.stopped is None else f"{self.stopped}, which a run starts"
        return summary if self.name is None else f"host {self.name}: {summary}"


class InferenceHosts:
    """One :class:`HealthMonitor` per host, for the settings of one tick or run; :meth:`close` after."""

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
            verdict, state = self._verdict(None, TickState.from_json(cursor))
            return [verdict], state.to_json()
        previous = _host_states(cursor)

        def one(name: str | None) -> tuple[HostVerdict, TickState]:
            return self._verdict(name, TickState.from_json(previous.get(str(name))))

        with ThreadPoolExecutor(max_workers=len(self.monitors)) as pool:
            results = dict(zip(self.monitors, pool.map(one, self.monitors), strict=True))
        verdicts = [verdict for verdict, _ in results.values()]
        states = {str(name): state.to_json() for name, (_, state) in results.items()}
        return verdicts, json.dumps({"hosts": states}, sort_keys=True)

    def _verdict(self, name: str | None, state: TickState) -> tuple[HostVerdict, TickState]:
        """The host's tick; when it is not healthy and the host has a managed server, whether that server
        is merely stopped (its status read over the monitor's connection)."""
        monitor = self.monitors[name]
        report, state = monitor.tick(state)
        setup = managed_server(monitor.config)
        if report.healthy or setup is None:
            return HostVerdict(name, report), state
        return HostVerdict(name, report, stopped_server(report, ManagedServer(monitor.host, setup))), state

    def choice(self, verdicts: list[HostVerdict]) -> HostChoice | None:
        """The healthy hosts to place partitions on (None with the single implicit host)."""
        if not self.several:
            return None
        healthy = {v.name for v in verdicts if v.open}
        return HostChoice(
            healthy=[LaunchHost(h.name, h.pool_name) for h in self.config.inference.hosts if h.name in healthy],
            unhealthy=frozenset(h.name for h in self.config.inference.hosts if h.name not in healthy),
        )

    def close(self) -> None:
        for monitor in self.monitors.values():
            monitor.close()


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
    sick = [v.line for v in verdicts if v.name is not None and not v.open]
    return "no new partitions for " + "; ".join(sick) if sick else ""


def claim_host(
    instance: dg.DagsterInstance,
    run_id: str,
    config: PipelineConfig,
    log: Callable[[str], None],
    names: PipelineNames = DEFAULT_NAMES,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """The host of run `run_id`, which has none yet: the first healthy host (file order) that no
    other unfinished run holds (host or pool), claimed with :func:`~eagle3_pipeline.orchestration.partition_runs.claim`
    — yielding to a run created first that claimed it too. With none free, it checks again every
    `launch.host_poll_s` (saying once per change what it waits for) and, after `launch.host_wait_s`,
    raises :class:`NoHostFree` with the reason."""
    settings = config.launch
    deadline = time.monotonic() + settings.host_wait_s
    hosts = InferenceHosts(config)
    said = ""
    try:
        while True:
            verdicts, _ = hosts.tick()
            choice = hosts.choice(verdicts)
            healthy = choice.healthy if choice is not None else []
            held = hosts_in_flight(instance, names, besides=run_id)
            yielded = []
            for host in [h for h in healthy if h.name not in held.hosts and h.pool not in held.pools]:
                first = claim(instance, run_id, host)
                if first is None:
                    log(f"placed on inference host {host.name} (pool {host.pool})")
                    return host.name
                yielded.append(f"{host.name} (claimed first by run {first[:8]})")
            why = "; ".join(
                part
                for part in (
                    sick_hosts_line(verdicts),
                    ", ".join(
                        f"host {name} busy (run {', '.join(r[:8] for r in runs)})"
                        for name, runs in sorted(held.hosts.items())
                    ),
                    ("yielded " + ", ".join(yielded)) if yielded else "",
                )
                if part
            )
            if time.monotonic() >= deadline:
                raise NoHostFree(
                    f"no healthy inference host was free within launch.host_wait_s = {settings.host_wait_s:g} s: {why}"
                )
            if why != said:
                log(f"waiting for a free healthy inference host: {why}")
                said = why
            sleep(settings.host_poll_s)
    finally:
        hosts.close()


def hold_host(
    instance: dg.DagsterInstance,
    run_id: str,
    *,
    launch: LaunchConfig,
    inference: InferenceConfig,
    host_name: str,
    log: Callable[[str], None],
    names: PipelineNames = DEFAULT_NAMES,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Make inference host ``host_name`` (and its pool) run ``run_id``'s, as :func:`claim_host` does for a
    generation run, healthy or not (the phase stops its server anyway): once no other unfinished run holds it,
    within `launch.host_wait_s` (:class:`NoHostFree` after, naming the runs that held it)."""
    host = inference.host(host_name)
    wanted = LaunchHost(host.name, host.pool_name)
    deadline = time.monotonic() + launch.host_wait_s
    said = ""
    while True:
        held = hosts_in_flight(instance, names, besides=run_id)
        holders = list(held.hosts.get(host.name, []))
        if not holders and host.pool_name not in held.pools:
            first = claim(instance, run_id, wanted)
            if first is None:
                log(f"holding inference host {host.name} (pool {host.pool_name}) for this run")
                return
            holders = [first]
        by = f"run(s) {', '.join(r[:8] for r in holders)}" if holders else "another run of its pool"
        why = f"inference host {host.name} (pool {host.pool_name}) is held by {by}"
        if time.monotonic() >= deadline:
            raise NoHostFree(f"{why} for longer than launch.host_wait_s = {launch.host_wait_s:g} s")
        if why != said:
            log(f"waiting: {why}")
            said = why
        sleep(launch.host_poll_s)
