"""A dead or hung inference server brought back mid-generation, once for all the requests it failed.

The caller hands the engine a :class:`ServerRecovery`: the endpoints it covers and ``recover``, a plain
blocking callable (for a managed server: :class:`eagle3_pipeline.managed.recovery.GenerationRecovery`,
which checks the server and restarts it). When an attempt on one of those endpoints fails the way a
dead or hung server fails (:data:`SERVER_DOWN_KINDS`: the connection refused, reset or dropped, no
answer in time, an HTTP 5xx — vLLM answers 500 to the requests in flight when its engine died),
:class:`SharedRecovery` runs ``recover`` in a thread, once: attempts that fail while
it runs wait for it and take its verdict, and no request is sent until it is over.

- ``recover`` found the server serving (:attr:`Recovered.restarted` false): the failure is an ordinary
  one (retried and counted as before).
- it restarted the server: the attempts that failed on the old one, and those still in flight on it
  (cancelled), are sent again and count against neither ``retry.max_attempts`` nor
  ``max_consecutive_errors``; one at a time, and a prompt in flight at two crashes is quarantined
  (:mod:`.quarantine`). An answer is written only when its request returns, so a request in flight when
  the server died is neither lost nor answered twice.
- it could not bring the server back (the restarts it allows are spent, or a start failed): it raises
  :class:`RecoveryFailed`, and the run stops with that message.

A failure on an attempt sent before the last recovery started takes that recovery's verdict instead of
starting another: the check already covered it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SERVER_DOWN_KINDS = frozenset({"connection", "timeout", "server_error"})


@dataclass(frozen=True)
class Recovered:
    """What ``recover`` found and did. ``restarted``: the server serves again after a restart (the failed
    attempts are sent again, uncounted); ``restarts``: each restart it made, a failed one included, for
    the run's metadata (reason, duration, …)."""

    restarted: bool
    detail: str
    restarts: tuple[dict[str, Any], ...] = ()


class RecoveryFailed(Exception):
    """The server could not be brought back; the message says why, with the server's log tail.
    ``restarts``: the restarts this recovery made before it gave up (each failed)."""

    def __init__(self, message: str, restarts: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(message)
        self.restarts = tuple(restarts)


@dataclass(frozen=True)
class ServerRecovery:
    """The caller's hook: the base URLs of the endpoints it covers, and ``recover(failure)`` (blocking;
    ``failure`` the failed attempt's reason) → :class:`Recovered`, or :class:`RecoveryFailed`."""

    endpoints: frozenset[str]
    recover: Callable[[str], Recovered]

    def serves(self, base_url: str) -> bool:
        """Whether requests to ``base_url`` go to the server this hook recovers."""
        return base_url.rstrip("/") in {url.rstrip("/") for url in self.endpoints}


class SharedRecovery:
    """One recovery at a time for a run's requests (module doc). ``on_restarts`` hears the restarts each
    recovery made (also when it gave up), ``on_restarted`` each recovery that brought the server back
    (the runner cancels the attempts still in flight on the old one), with when that recovery started and
    its verdict."""

    def __init__(
        self,
        hook: ServerRecovery,
        on_restarts: Callable[[Sequence[dict[str, Any]]], None],
        on_restarted: Callable[[float, Recovered], None],
    ) -> None:
        self.hook = hook
        self.on_restarts = on_restarts
        self.on_restarted = on_restarted
        self.running: asyncio.Task[Recovered] | None = None
        self.last: tuple[float, Recovered] | None = None  # (when it started, its verdict)
        self.failed: RecoveryFailed | None = None

    def covers(self, base_url: str, kind: str) -> bool:
        """Whether a failure of ``kind`` on ``base_url`` is one to check the server for."""
        return kind in SERVER_DOWN_KINDS and self.hook.serves(base_url)

    async def ready(self) -> None:
        """Return once no recovery runs (a request waits here before it is sent)."""
        while self.running is not None:
            await asyncio.shield(self.running)
        if self.failed is not None:
            raise self.failed

    async def after_failure(self, failure: str, sent_at: float) -> Recovered:
        """The verdict on an attempt sent at ``sent_at`` (``time.monotonic``) that failed with ``failure``:
        the running recovery's, the last one's if it started after the attempt was sent, else a new one's."""
        if self.failed is not None:
            raise self.failed
        if self.running is not None:
            return await asyncio.shield(self.running)
        if self.last is not None and self.last[0] >= sent_at:
            return self.last[1]
        self.running = asyncio.create_task(self._recover(failure))
        return await asyncio.shield(self.running)

    async def _recover(self, failure: str) -> Recovered:
        started = time.monotonic()
        try:
            verdict = await asyncio.to_thread(self.hook.recover, failure)
        except RecoveryFailed as exc:
            self.failed = exc
            self.on_restarts(exc.restarts)
            raise
        finally:
            self.running = None
        self.last = (started, verdict)
        self.on_restarts(verdict.restarts)
        if verdict.restarted:
            self.on_restarted(started, verdict)
        return verdict
