"""What the phases ask of a managed server: to serve for a purpose, to give the GPUs up, or to give them
up for a while and come back.

A :class:`Supervisor` wraps one :class:`~eagle3_pipeline.managed.lifecycle.ManagedServer` and the launch
lines of its pipeline. :meth:`Supervisor.ensure` keeps a running server whose launch line is the one asked
for, but for flags the purpose does not use (:func:`~.launch.serves`: the benchmark's token-id arms do not
use the chat parsers), or whose role the caller accepts (e.g. a server of the trained drafter for
generation), waiting until it is ready when it is still loading; otherwise it stops what runs and starts
the right one. :meth:`Supervisor.release` stops it; :meth:`Supervisor.handover` releases it for a
GPU-exclusive phase and afterwards starts what the caller says is needed then (nothing, when no work is
left for a server); :meth:`Supervisor.arms` is the same without the release first, for a phase that starts
its own servers through it (the benchmark); :meth:`Supervisor.serving` serves a phase's own purpose for a
block (the extraction server) with the same afterwards. A start that fails is reported too (``failed``,
with the last line of the server's log) before its error is raised. Every start, stop and reuse is
reported to ``on_event`` as a :class:`ServerEvent`, which the Dagster layer records on the run and as an
observation of the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.hosts import build_host
from eagle3_pipeline.managed.errors import ManagedServerError, StartupFailedError
from eagle3_pipeline.managed.launch import LaunchLine, ServerPurpose, serves
from eagle3_pipeline.managed.lifecycle import ManagedServer, StopResult
from eagle3_pipeline.managed.processes import ServerRecord
from eagle3_pipeline.managed.servers import launch_for, managed_server

# kept: a running server serves the purpose (or is left running by a recovery that did not restart it); failed:
# it was found dead or hung, or a start (a restart) failed; probed: one probe of a recovery's hang check
Action = Literal["started", "stopped", "kept", "failed", "probed"]


@dataclass(frozen=True)
class ServerEvent:
    """One thing done to (or found about) a managed server, with why and the lifecycle's figures."""

    action: Action
    server: str
    role: str | None
    reason: str
    duration_s: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        role = f" ({self.role})" if self.role else ""
        took = f" in {self.duration_s:.1f} s" if self.action in ("started", "stopped") else ""
        return f"managed server {self.server}{role} {self.action}{took}: {self.reason}"

    def as_metadata(self) -> dict[str, Any]:
        return {"event": self.action, **self.metadata, "reason": self.reason, "duration_s": round(self.duration_s, 3)}


EventSink = Callable[[ServerEvent], None]


def ignore(_: ServerEvent) -> None:
    return None


class Supervisor:
    """The phases' view of one managed server (module doc); ``launch`` builds its launch line for a purpose."""

    def __init__(
        self, server: ManagedServer, launch: Callable[[ServerPurpose], LaunchLine], on_event: EventSink = ignore
    ) -> None:
        self.server = server
        self.launch = launch
        self.on_event = on_event

    @property
    def name(self) -> str:
        return self.server.setup.name

    def ensure(self, purpose: ServerPurpose, reason: str, accept: Collection[str] = ()) -> LaunchLine:
        """The server serving ``purpose``: kept when it runs that launch line (or a role in ``accept``),
        else what runs is stopped (verified) and the right one started. Returns the launch line serving now."""
        return self.ensure_launch(self.launch(purpose), reason, accept)

    def ensure_launch(self, wanted: LaunchLine, reason: str, accept: Collection[str] = ()) -> LaunchLine:
        """:meth:`ensure` for a launch line given whole (e.g. a recorded one, to roll back to)."""
        status = self.server.status()
        record = status.record
        if status.state == "running" and record is not None:
            if serves(record.argv, wanted) or record.role in accept:
                ready = "" if record.cmdline is not None else self._await(record, wanted, reason)
                self.on_event(
                    ServerEvent(
                        "kept",
                        self.name,
                        record.role,
                        f"{reason}: running since {record.started_at}{ready}",
                        metadata={"pid": record.pid, "port": record.port},
                    )
                )
                return wanted if tuple(record.argv) == tuple(wanted.argv) else replace(wanted, argv=tuple(record.argv))
            self._stop(f"{reason}: it runs as {record.role}, {wanted.purpose.role} is needed")
        elif status.state in ("orphaned", "foreign"):
            raise ManagedServerError(f"{self.server.setup.setting}: cannot start for {reason}: {status.detail}")
        try:
            result = self.server.start(wanted, reason)
        except StartupFailedError as exc:
            self._failed(wanted, reason, exc)
            raise
        self.on_event(ServerEvent("started", self.name, result.role, reason, result.duration_s, result.as_metadata()))
        return wanted

    def _await(self, record: ServerRecord, wanted: LaunchLine, reason: str) -> str:
        """A kept server recorded at its launch but not yet ready (another run's start, or one whose connection
        dropped) is waited for until ready (``startup_timeout_s``); one that does not get ready is stopped and
        reported as a failed start."""
        started = time.monotonic()
        try:
            self.server.await_ready(record)
        except StartupFailedError as exc:
            self._failed(wanted, reason, exc)
            raise
        return f", waited {time.monotonic() - started:.1f} s until it was ready"

    def _failed(self, wanted: LaunchLine, reason: str, exc: StartupFailedError) -> None:
        why = exc.log_tail.strip().splitlines()[-1] if exc.log_tail.strip() else str(exc).splitlines()[0]
        stopped = exc.stop.as_metadata() if exc.stop is not None else {}
        failed = f"{reason}: it did not start: {why}"
        self.on_event(ServerEvent("failed", self.name, wanted.purpose.role, failed, metadata=stopped))

    def release(self, reason: str) -> StopResult | None:
        """Stop the server if one of ours runs (verified); None when none did."""
        status = self.server.status()
        if status.state in ("absent", "exited"):
            return None
        return self._stop(reason)

    @contextmanager
    def handover(self, reason: str, after: Callable[[], ServerPurpose | None]) -> Iterator[None]:
        """The GPUs for the ``with`` block: the server is stopped first, and afterwards (also when the block
        fails) started for ``after()``'s purpose, or stopped when it returns None (a server the block
        started for itself, e.g. the benchmark's, is not left holding the GPUs)."""
        self.release(f"{reason} needs the GPUs")
        try:
            yield
        finally:
            self._afterwards(reason, after)

    @contextmanager
    def arms(self, reason: str, after: Callable[[], ServerPurpose | None]) -> Iterator[None]:
        """The GPUs for a ``with`` block that starts its own servers through :meth:`ensure` (the benchmark's
        arms): nothing is stopped first, so an arm whose launch line the running server serves keeps it (the
        baseline arm on the generation server); afterwards as after :meth:`handover`."""
        try:
            yield
        finally:
            self._afterwards(reason, after)

    @contextmanager
    def serving(
        self, purpose: ServerPurpose, phase: str, after: Callable[[], ServerPurpose | None]
    ) -> Iterator[LaunchLine]:
        """The server for ``purpose`` during the ``with`` block of ``phase`` (e.g. the extraction server for
        hidden_states), then, as after :meth:`handover`, the one ``after()`` asks for, or none. Yields the
        launch line."""
        launch = self.ensure(purpose, f"{phase} needs the {purpose.role} server")
        try:
            yield launch
        finally:
            self._afterwards(phase, after)

    def _afterwards(self, reason: str, after: Callable[[], ServerPurpose | None]) -> None:
        purpose = after()
        if purpose is not None:
            self.ensure(purpose, f"after {reason}: {purpose.role} work remains")
        else:
            self.release(f"after {reason}: no work waits for the server")

    def _stop(self, reason: str) -> StopResult:
        result = self.server.stop(reason)
        self.on_event(ServerEvent("stopped", self.name, result.role, reason, result.duration_s, result.as_metadata()))
        return result


@contextmanager
def open_supervisor(
    config: PipelineConfig, host_name: str | None = None, on_event: EventSink = ignore
) -> Iterator[Supervisor | None]:
    """The supervisor of the managed server of ``host_name`` (None: the pipeline's only or first one), its
    host connected for the ``with`` block; None when that server is not managed."""
    setup = managed_server(config, host_name)
    if setup is None:
        yield None
        return
    host = build_host(setup.host)
    try:
        yield Supervisor(
            ManagedServer(host, setup), lambda purpose: launch_for(config.target, setup, purpose), on_event
        )
    finally:
        host.close()
