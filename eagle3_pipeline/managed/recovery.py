"""A managed generation server brought back when it dies or hangs mid-generation: the recovery hook the
generation engine calls (:mod:`eagle3_pipeline.generation.recovery`) when requests fail the way a dead or
hung server fails.

:class:`GenerationRecovery` (blocking; the engine runs it in a thread, once for all the failed requests):

1. what the pid file and ``/proc`` say (:meth:`ManagedServer.status`): ``exited`` / ``absent`` → it
   **died** (crashed, killed); ``orphaned`` → it died and left processes; ``foreign`` → the pid file
   names a process the pipeline did not start: the run fails, nothing is signalled. ``running`` → the
   server is probed (the health tick's process, port and generation checks, each generation probe given
   ``serving.hang_probe_timeout_s``) on the window of :mod:`.hang`: one probe that answers → it
   **serves**, nothing is done (the failure was an ordinary one); ``serving.hang_probes`` failed probes in
   a row over the window → **hung**; probes that cannot tell (UNKNOWN) never restart it: past the
   window's bound the check reports that it cannot tell, and the failures stay ordinary ones. The status
   is read again before each probe, so a server that dies meanwhile is found dead.
2. a restart, at most ``serving.max_restarts`` in the run: wait ``serving.restart_backoff_s`` (doubled
   for each further restart), stop what is left of it (verified; a hung or orphaned server only), start
   the generation server again (:meth:`Supervisor.ensure`, its events on the run). A start that fails
   counts as a restart too.
3. past the bound: :class:`~eagle3_pipeline.generation.RecoveryFailed` naming each restart and the server
   log's tail (the run fails with it; the Dagster layer alerts).

Each probe is a ``probed`` :class:`ServerEvent` (its outcome and detail), each finding a ``failed`` one
(state, why, the request failure that led to it) or, for a server that serves or cannot be judged, a
``kept`` one; each restart is a record (reason, the probes that decided it, backoff, duration) for the
run's metadata.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from eagle3_pipeline.config import ServingConfig
from eagle3_pipeline.generation.recovery import Recovered, RecoveryFailed, ServerRecovery
from eagle3_pipeline.health import run_health_tick
from eagle3_pipeline.hosts import HostError
from eagle3_pipeline.managed.errors import ManagedServerError
from eagle3_pipeline.managed.hang import HangPolicy, HangWatch, probe_outcome
from eagle3_pipeline.managed.launch import ServerPurpose
from eagle3_pipeline.managed.outcomes import ServerStatus
from eagle3_pipeline.managed.supervisor import Action, ServerEvent, Supervisor

FAILED_TAIL_LINES = 40
STATUS_POLL_S = 5.0  # how often the pid file and /proc are read while the hang check waits for its next probe


@dataclass(frozen=True)
class Finding:
    """What the server was found to be after requests failed; ``restart`` false when it serves."""

    state: str  # serving | unknown (the probes could not tell) | hung | died | orphaned
    detail: str
    probes: tuple[dict[str, Any], ...] = field(default=())

    @property
    def restart(self) -> bool:
        return self.state not in ("serving", "unknown")


class GenerationRecovery:
    """The recovery hook of a run that generates on ``supervisor``'s server for ``purpose`` (module doc);
    ``reason`` names the run in events (e.g. ``responses B1``), ``accept`` the roles kept as serving it."""

    def __init__(
        self,
        supervisor: Supervisor,
        purpose: ServerPurpose,
        reason: str,
        accept: Collection[str] = (),
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.supervisor = supervisor
        self.purpose = purpose
        self.reason = reason
        self.accept = tuple(accept)
        self.sleep = sleep
        self.restarts: list[dict[str, Any]] = []

    @property
    def serving(self) -> ServingConfig:
        return self.supervisor.server.setup.serving

    def hook(self) -> ServerRecovery:
        """The engine's hook: this server's endpoint (its base URL) and :meth:`__call__`."""
        return ServerRecovery(frozenset({self.supervisor.server.setup.base_url}), self)

    def inspect(self) -> Finding:
        """Whether the server serves, is hung, died or left processes, or the probes cannot tell (module
        doc, step 1)."""
        server = self.supervisor.server
        status = self._status()
        if status.state != "running":
            return Finding("orphaned" if status.state == "orphaned" else "died", status.detail)
        record = status.record
        policy = HangPolicy.of(self.serving, record.ready_s if record is not None else None)
        thresholds = server.setup.thresholds
        thresholds = replace(
            thresholds,
            generation_timeout_s=policy.probe_timeout_s,
            tick_timeout_s=policy.probe_timeout_s + thresholds.shell_section_timeout_s,
        )
        watch = HangWatch(policy)
        began = time.monotonic()
        while True:
            if watch.probes:
                died = self._until(began + watch.next_probe_at(), watch)
                if died is not None:
                    return died
            started = time.monotonic() - began
            report, _ = run_health_tick(server.host, server.setup.server_spec(), thresholds)
            outcome, detail = probe_outcome(report)
            verdict = watch.add(outcome, started, time.monotonic() - began, detail)
            self._probed(watch.probes[-1])
            if verdict == "serving":
                return Finding("serving", f"{status.detail}; it answers ({detail})", tuple(watch.probes))
            if verdict is not None:
                return Finding(verdict, f"{status.detail}, but {watch.summary()}; last: {detail}", tuple(watch.probes))

    def _until(self, when: float, watch: HangWatch) -> Finding | None:
        """Wait until ``when`` (``time.monotonic``) for the next probe, reading the pid file and ``/proc`` every
        :data:`STATUS_POLL_S`: the finding when the server died meanwhile, else None."""
        while True:
            status = self._status()
            if status.state != "running":
                state = "orphaned" if status.state == "orphaned" else "died"
                return Finding(state, f"{status.detail} (while probed: {watch.summary()})", tuple(watch.probes))
            wait = when - time.monotonic()
            if wait <= 0:
                return None
            time.sleep(min(wait, STATUS_POLL_S))

    def _status(self) -> ServerStatus:
        server = self.supervisor.server
        status = server.status()
        if status.state == "foreign":
            raise RecoveryFailed(
                f"the managed server {self.supervisor.name} cannot be recovered: {status.detail}; "
                f"nothing was signalled (pid file {server.pid_path})"
            )
        return status

    def __call__(self, failure: str) -> Recovered:
        made = len(self.restarts)
        try:
            finding = self.inspect()
            if not finding.restart:
                what = "serves" if finding.state == "serving" else "could not be judged, so it is not restarted"
                self._event("kept", f"{finding.state}: {finding.detail}", {"state": finding.state, "failure": failure})
                return Recovered(False, f"the managed server {what}: {finding.detail}")
            self._event("failed", f"{finding.state}: {finding.detail}", {"state": finding.state, "failure": failure})
            return Recovered(True, self._restart(finding, failure), tuple(self.restarts[made:]))
        except (ManagedServerError, HostError) as exc:
            message = f"the managed server {self.supervisor.name} could not be recovered: {exc}"
            raise RecoveryFailed(message, self.restarts[made:]) from None
        except RecoveryFailed as exc:
            raise RecoveryFailed(str(exc), self.restarts[made:]) from None

    def _restart(self, finding: Finding, failure: str) -> str:
        """Restart until the server serves again (returns what was done) or the bound is reached (module
        doc, steps 2 and 3)."""
        serving = self.serving
        why = f"{finding.state}: {finding.detail}"
        while True:
            tail = self.supervisor.server.log_tail(FAILED_TAIL_LINES)
            if len(self.restarts) >= serving.max_restarts:
                raise RecoveryFailed(self._gave_up(why, tail))
            number = len(self.restarts) + 1
            backoff = serving.restart_backoff_s * 2 ** (number - 1)
            self.sleep(backoff)
            reason = f"{self.reason}: restart {number} of at most {serving.max_restarts} ({why})"
            started = time.monotonic()
            record: dict[str, Any] = {
                "restart": number,
                "reason": why,
                "request_failure": failure,
                "probes": list(finding.probes),
                "backoff_s": round(backoff, 3),
                "at": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            try:
                if finding.state in ("hung", "orphaned"):
                    self.supervisor.release(reason)
                self.supervisor.ensure(self.purpose, reason, self.accept)
            except ManagedServerError as exc:
                record.update(duration_s=round(time.monotonic() - started, 3), outcome=f"failed: {exc}")
                self.restarts.append(record)
                why = f"restart {number} failed: {exc}"
                self._event("failed", why, {"state": "start failed"})
                finding = Finding("died", str(exc))
                continue
            record.update(duration_s=round(time.monotonic() - started, 3), outcome="serving")
            self.restarts.append(record)
            return f"restarted in {record['duration_s']:.1f} s after {why}"

    def _gave_up(self, why: str, tail: str) -> str:
        serving, server = self.serving, self.supervisor.server
        done = "; ".join(
            f"{r['restart']}. after {r['reason']} ({r['outcome']} in {r['duration_s']:.1f} s)" for r in self.restarts
        )
        return (
            f"the managed server {self.supervisor.name} ({server.host.name}) failed again after "
            f"{len(self.restarts)} restart(s), the most serving.max_restarts = {serving.max_restarts} allows in a "
            f"run: {why}. Restarts: {done or 'none'}. Log {server.log_path}, last lines:\n{tail}"
        )

    def _event(self, action: Action, why: str, metadata: dict[str, Any]) -> None:
        """A ``failed`` event (what was found, or a restart that failed) or a ``kept`` one (no restart)."""
        self.supervisor.on_event(
            ServerEvent(action, self.supervisor.name, self.purpose.role, f"{self.reason}: {why}", metadata=metadata)
        )

    def _probed(self, probe: dict[str, Any]) -> None:
        """A ``probed`` event: one probe of the hang check, its outcome and what it found."""
        why = f"{self.reason}: hang check probe {probe['probe']}: {probe['outcome']} ({probe['detail']})"
        self.supervisor.on_event(ServerEvent("probed", self.supervisor.name, self.purpose.role, why, metadata=probe))
