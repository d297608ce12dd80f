"""A managed generation server brought back when it dies or hangs mid-generation: the recovery hook the
generation engine calls (:mod:`eagle3_pipeline.generation.recovery`) when requests fail the way a dead or
hung server fails.

:class:`GenerationRecovery` (blocking; the engine runs it in a thread, once for all the failed requests):

1. what the pid file and ``/proc`` say (:meth:`ManagedServer.status`): ``running`` → the health tick
   (process, port, a generation): all pass → the server serves, nothing is done (the failure was an
   ordinary one); else it is **hung**. ``exited`` / ``absent`` → it **died** (crashed, killed);
   ``orphaned`` → it died and left processes; ``foreign`` → the pid file names a process the pipeline
   did not start: the run fails, nothing is signalled.
2. a restart, at most ``serving.max_restarts`` in the run: wait ``serving.restart_backoff_s`` (doubled
   for each further restart), stop what is left of it (verified; a hung or orphaned server only), start
   the generation server again (:meth:`Supervisor.ensure`, its events on the run). A start that fails
   counts as a restart too.
3. past the bound: :class:`~eagle3_pipeline.generation.RecoveryFailed` naming each restart and the server
   log's tail (the run fails with it; the Dagster layer alerts).

Each finding is a ``failed`` :class:`ServerEvent` (state, why, the request failure that led to it), and
each restart a record (reason, backoff, duration) for the run's metadata.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from eagle3_pipeline.config import ServingConfig
from eagle3_pipeline.generation.recovery import Recovered, RecoveryFailed, ServerRecovery
from eagle3_pipeline.health import Status, run_health_tick
from eagle3_pipeline.managed.launch import ServerPurpose
from eagle3_pipeline.managed.lifecycle import READY_CHECKS, ManagedServerError
from eagle3_pipeline.managed.supervisor import ServerEvent, Supervisor

FAILED_TAIL_LINES = 40


@dataclass(frozen=True)
class Finding:
    """What the server was found to be after requests failed; ``restart`` false when it serves."""

    state: str  # serving | hung | died | orphaned
    detail: str

    @property
    def restart(self) -> bool:
        return self.state != "serving"


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
        return self.supervisor.server.plan.serving

    def hook(self) -> ServerRecovery:
        """The engine's hook: this server's endpoint (its base URL) and :meth:`__call__`."""
        return ServerRecovery(frozenset({self.supervisor.server.plan.base_url}), self)

    def inspect(self) -> Finding:
        """Whether the server serves, is hung, died or left processes (module doc, step 1)."""
        server = self.supervisor.server
        status = server.status()
        if status.state == "foreign":
            raise RecoveryFailed(
                f"the managed server {self.supervisor.name} cannot be recovered: {status.detail}; "
                f"nothing was signalled (pid file {server.pid_path})"
            )
        if status.state == "orphaned":
            return Finding("orphaned", status.detail)
        if status.state != "running":
            return Finding("died", status.detail)
        plan = server.plan
        report, _ = run_health_tick(server.host, plan.server_spec(), plan.thresholds)
        failing = [c for c in report.checks if c.name in READY_CHECKS and c.status != Status.OK]
        if not failing:
            return Finding("serving", f"{status.detail}; it answers ({report.summary()})")
        shown = "; ".join(f"{c.name} {c.status.value}: {c.detail}" for c in failing)
        return Finding("hung", f"{status.detail}, but {shown}")

    def __call__(self, failure: str) -> Recovered:
        made = len(self.restarts)
        try:
            finding = self.inspect()
            if not finding.restart:
                return Recovered(False, f"the managed server serves: {finding.detail}")
            self._failed(f"{finding.state}: {finding.detail}", {"state": finding.state, "failure": failure})
            return Recovered(True, self._restart(finding, failure), tuple(self.restarts[made:]))
        except ManagedServerError as exc:
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
                self._failed(why, {"state": "start failed"})
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

    def _failed(self, why: str, metadata: dict[str, Any]) -> None:
        """A ``failed`` event: what was found (or a restart that failed)."""
        self.supervisor.on_event(
            ServerEvent("failed", self.supervisor.name, self.purpose.role, f"{self.reason}: {why}", metadata=metadata)
        )
