"""`run_health_tick`: every check once, within a bounded time.

One tick makes one shell round trip to the host (`script`) and, at the same time, the HTTP
requests: a 1-token completion to each generation target (`checks.generation`) and a metrics
scrape of the monitored server (`checks.throughput`), each in its own thread. The tick as a whole
is bounded by `HealthThresholds.tick_timeout_s`: whatever has not answered by then (a hung host,
a trickling server) is reported as UNKNOWN, and the tick returns.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from typing import Generic, TypeVar

from eagle3_pipeline.health.checks import disk, generation, gpus, host_memory, port, progress, server_process
from eagle3_pipeline.health.checks.generation import CachedVerdict
from eagle3_pipeline.health.checks.throughput import (
    MetricsScrape,
    ThroughputBaseline,
    evaluate_throughput,
    fetch_metrics,
)
from eagle3_pipeline.health.report import CheckResult, HealthReport, Status, Verdict
from eagle3_pipeline.health.script import Section, ShellOutcome, run_shell_probes
from eagle3_pipeline.health.settings import CHECK_NAMES, GenerationTarget, HealthThresholds, ServerSpec
from eagle3_pipeline.hosts import Host

__all__ = ["TickState", "probe_sections", "run_health_tick"]


@dataclass(frozen=True)
class TickState:
    """What a tick hands to the next one: the last token-counter scrape and the hosted targets'
    last verdicts (by URL, never with a key). JSON for a sensor cursor."""

    throughput: ThroughputBaseline | None = None
    generation: Mapping[str, CachedVerdict] = field(default_factory=dict)

    def to_json(self) -> str:
        baseline = self.throughput.to_dict() if self.throughput is not None else None
        cached = {url: verdict.to_dict() for url, verdict in self.generation.items()}
        return json.dumps({"version": 2, "throughput": baseline, "generation": cached}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> TickState:
        """Parse a cursor; an empty or unreadable one starts afresh."""
        if not text:
            return cls()
        try:
            data = json.loads(text)
            baseline = data.get("throughput")
            cached = {str(url): CachedVerdict.from_dict(v) for url, v in (data.get("generation") or {}).items()}
            return cls(ThroughputBaseline.from_dict(baseline) if baseline else None, cached)
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls()


def probe_sections(thresholds: HealthThresholds, with_server: bool = True) -> list[Section]:
    """The (name, argv) sections a tick runs on the host."""
    sections: list[Section] = [server_process.SECTION, port.SECTION] if with_server else []
    if thresholds.expected_gpus > 0:
        sections += gpus.sections(thresholds.kernel_log_path)
    sections += [disk.section(thresholds.disk_path), host_memory.SECTION]
    if thresholds.log_path is not None:
        sections.append(progress.log_section(thresholds.log_path))
    if thresholds.artifacts_dir is not None:
        sections.append(progress.outputs_section(thresholds.artifacts_dir))
    return sections


T = TypeVar("T")


class _Background(Generic[T]):
    """Runs a call in a daemon thread so the tick can stop waiting for it at its deadline."""

    def __init__(self, name: str, call: Callable[[], T]) -> None:
        self._call = call
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"health-tick-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._call()
        except BaseException as exc:  # surfaced to the waiting thread by `wait`
            self._error = exc

    def wait(self, deadline: float) -> T:
        """The call's result; raises its exception, or TimeoutError past the deadline."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            raise TimeoutError
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


def run_health_tick(
    host: Host,
    spec: ServerSpec | None,
    thresholds: HealthThresholds,
    state: TickState | None = None,
    targets: Sequence[GenerationTarget] = (),
    deferred: str | None = None,
) -> tuple[HealthReport, TickState]:
    """Run every check once; returns the report and the state for the next tick.

    `targets` are the servers work is sent to; the monitored server `spec` (its process, port and
    throughput on `host`) is a target too. Every target gets a 1-token completion; with none at
    all the `generation` check is UNKNOWN (no evidence is not health) — optional only when
    `deferred` says who probes the server later (an embedded server its run starts and preflights).

    Never raises for an unhealthy or unreachable host: such failures are CRITICAL or UNKNOWN
    checks. Returns within `thresholds.tick_timeout_s` (plus a few milliseconds).
    """
    state = state or TickState()
    deadline = time.monotonic() + thresholds.tick_timeout_s
    budget = thresholds.tick_timeout_s
    sections = probe_sections(thresholds, with_server=spec is not None)
    shell = _Background("shell", lambda: run_shell_probes(host, sections, thresholds.shell_section_timeout_s))
    metrics = (
        _Background("metrics", lambda: fetch_metrics(spec, thresholds.metrics_timeout_s))
        if spec is not None and spec.metrics_endpoint
        else None
    )
    now = time.time()
    all_targets = _targets(spec, targets)
    interval = thresholds.hosted_probe_interval_s
    reused = {t.label: generation.reuse(t, state.generation.get(t.label), now, interval) for t in all_targets}
    probes = {
        t.label: _Background("generation", partial(generation.probe_generation, t, thresholds.generation_timeout_s))
        for t in all_targets
        if reused[t.label] is None
    }

    shell_outcome = _wait(shell, deadline, budget, lambda why: ShellOutcome({}, f"shell probes {why}"))
    scrape = _wait(metrics, deadline, budget, lambda why: f"metrics scrape {why}") if metrics is not None else None
    results: list[tuple[GenerationTarget, Verdict]] = []
    for target in all_targets:
        verdict = reused[target.label] or _wait(
            probes[target.label], deadline, budget, lambda why: Verdict(Status.UNKNOWN, f"generation probe {why}")
        )
        results.append((target, verdict))

    verdicts = _shell_verdicts(shell_outcome, spec, thresholds, scrape)
    verdicts["generation"] = (
        generation.combine(results) if results else Verdict(Status.UNKNOWN, deferred or "no inference server to probe")
    )
    next_state = TickState(state.throughput, _cache(state, results, reused, now))
    if scrape is not None and spec is not None:
        verdicts["throughput"], baseline = _throughput(scrape, state, host, spec, thresholds)
        next_state = TickState(baseline, next_state.generation)
    optional = thresholds.optional_checks | ({"generation"} if deferred and not results else set())
    return _report(verdicts, host, optional, results), next_state


def _targets(spec: ServerSpec | None, targets: Sequence[GenerationTarget]) -> list[GenerationTarget]:
    """The targets and the monitored server; at the same URL they are one target, asked the way
    the server section says (`generation_probe`) with the endpoint's key — every tick, as the server on
    the host it is, never cached as a hosted API's is (a managed server's endpoint has a key variable too)."""
    chosen = {t.label: t for t in targets}
    if spec is not None:
        monitored = spec.target()
        known = chosen.get(monitored.label)
        chosen[monitored.label] = (
            replace(known, probe=monitored.probe, api_key=known.api_key or monitored.api_key, api_key_env=None)
            if known is not None
            else monitored
        )
    return list(chosen.values())


def _cache(
    state: TickState,
    results: Sequence[tuple[GenerationTarget, Verdict]],
    reused: Mapping[str, Verdict | None],
    now: float,
) -> dict[str, CachedVerdict]:
    """Hosted targets' fresh verdicts replace their cached ones; reused ones keep their age."""
    cached = {}
    for target, verdict in results:
        if not target.hosted:
            continue
        fresh = reused[target.label] is None
        cached[target.label] = (
            CachedVerdict(verdict.status, verdict.detail, now) if fresh else state.generation[target.label]
        )
    return cached


def _wait(job: _Background[T], deadline: float, budget_s: float, failed: Callable[[str], T]) -> T:
    """The job's result, or `failed(why)` if it raised or is still running at the deadline."""
    try:
        return job.wait(deadline)
    except TimeoutError:
        return failed(f"did not finish within the tick's {budget_s:g} s")
    except Exception as exc:
        return failed(f"failed: {type(exc).__name__}: {exc}")


def _shell_verdicts(
    outcome: ShellOutcome, spec: ServerSpec | None, thresholds: HealthThresholds, scrape: MetricsScrape | str | None
) -> dict[str, Verdict]:
    sections, missing, timeout = outcome.sections, outcome.failure, thresholds.shell_section_timeout_s
    verdicts: dict[str, Verdict] = {}
    if spec is not None:
        verdicts["server_process"], server_pids = server_process.process_verdict(
            sections.get("ps"), spec, outcome, timeout
        )
        verdicts["port"] = port.port_verdict(sections.get("ss"), spec.port, server_pids, missing, timeout)
    verdicts["gpus"] = gpus.evaluate_gpu_sections(
        sections.get("gpu"),
        sections.get("remap"),
        sections.get("xid"),
        expected=thresholds.expected_gpus,
        temp_warn_c=thresholds.gpu_temp_warn_c,
        temp_critical_c=thresholds.gpu_temp_critical_c,
        missing=missing,
        timeout_s=timeout,
    )
    disk_section, mem_section = sections.get("disk"), sections.get("mem")
    verdicts["disk"] = (
        Verdict(Status.UNKNOWN, missing)
        if disk_section is None
        else disk.evaluate_disk(disk_section, thresholds.min_disk_free_gb, timeout)
    )
    verdicts["host_memory"] = (
        Verdict(Status.UNKNOWN, missing)
        if mem_section is None
        else host_memory.evaluate_memory(mem_section, thresholds.min_mem_free_gb, timeout)
    )
    if thresholds.log_path is not None or thresholds.artifacts_dir is not None:
        verdicts["progress"] = progress.evaluate_progress(
            sections.get("log"),
            sections.get("outputs"),
            busy=_busy(scrape) if spec is not None else False,
            stall_window_s=thresholds.stall_window_s,
            timeout_s=timeout,
            missing=missing,
        )
    return verdicts


def _busy(scrape: MetricsScrape | str | None) -> bool | None:
    if not isinstance(scrape, MetricsScrape) or scrape.running is None:
        return None
    return scrape.running > 0


def _throughput(
    scrape: MetricsScrape | str, state: TickState, host: Host, spec: ServerSpec, thresholds: HealthThresholds
) -> tuple[Verdict, ThroughputBaseline | None]:
    if isinstance(scrape, str):
        return Verdict(Status.UNKNOWN, scrape), state.throughput
    outcome = evaluate_throughput(
        scrape,
        state.throughput,
        server=f"{host.name}:{spec.port}",
        now=time.time(),
        min_interval_s=thresholds.throughput_min_interval_s,
    )
    return outcome.verdict, outcome.baseline


def _report(
    verdicts: Mapping[str, Verdict],
    host: Host,
    optional: frozenset[str] | set[str],
    targets: Sequence[tuple[GenerationTarget, Verdict]],
) -> HealthReport:
    """Host checks carry the host's name; `generation` the servers it asked."""
    servers = ", ".join(target.label for target, _ in targets) or "-"
    checks = tuple(
        CheckResult(
            name=name,
            status=verdicts[name].status,
            detail=verdicts[name].detail,
            host=servers if name == "generation" else host.name,
            data=verdicts[name].data,
            required=name not in optional,
        )
        for name in CHECK_NAMES
        if name in verdicts
    )
    return HealthReport(checks=checks, taken_at=datetime.now(UTC))
