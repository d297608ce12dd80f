"""Poison requests: a prompt that takes the server down is found and set aside, so that it costs at most
two restarts, in this run and none in the next.

When a recovery restarted the server (:mod:`.recovery`), every prompt with a request in flight at the crash
is a **suspect**. Suspects are sent again **one at a time, alone**: while any is left, no other request is
sent, and a suspect waits until nothing else is in flight. A suspect that is answered (or fails for another
reason) is cleared. A prompt in flight at **two** crashes — after the first it was alone, so the second
crash is its own — is **quarantined**: never sent again, written to the dataset's errors file with
``"quarantined": true`` and the reason (the restarts it was in flight at), counted as failed against
``max_failed_fraction``; the run goes on with the others. The next run reads the errors file and leaves the
quarantined prompts out (:func:`quarantined_ids`); delete a prompt's line there to send it again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from pathlib import Path

CRASHES_TO_QUARANTINE = 2
QUARANTINED_KIND = "quarantined"


class Quarantined(Exception):
    """The prompt is quarantined (the reason): its request is not sent."""


class Quarantine:
    """A run's suspects and quarantined prompts, and the gate that sends suspects one at a time (module doc)."""

    def __init__(self) -> None:
        self.crashes: dict[str, list[int]] = {}  # prompt id → the restarts it was in flight at
        self.suspects: set[str] = set()
        self.quarantined: dict[str, str] = {}  # prompt id → why
        self.in_flight: dict[str, int] = {}  # prompt id → requests being sent
        self.changed = asyncio.Condition()

    def crashed(self, in_flight: Iterable[str], restart: int, why: str) -> list[str]:
        """The server was restarted (restart number ``restart``, after ``why``) with ``in_flight`` prompts'
        requests in flight: they become suspects, or quarantined at their second crash. Returns those
        quarantined now."""
        now: list[str] = []
        for prompt_id in sorted(set(in_flight)):
            if prompt_id in self.quarantined:
                continue
            restarts = self.crashes.setdefault(prompt_id, [])
            restarts.append(restart)
            if len(restarts) >= CRASHES_TO_QUARANTINE:
                self.suspects.discard(prompt_id)
                shown = " and ".join(str(r) for r in restarts)
                self.quarantined[prompt_id] = (
                    f"quarantined: its request was in flight at {len(restarts)} server crashes (restarts {shown}; "
                    f"the last sent alone, after {why}); it is not sent again"
                )
                now.append(prompt_id)
            else:
                self.suspects.add(prompt_id)
        return now

    async def turn(self, prompt_id: str) -> None:
        """Wait until ``prompt_id``'s request may be sent (module doc) and count it in flight; raises
        :class:`Quarantined` for a quarantined prompt."""
        async with self.changed:
            await self.changed.wait_for(lambda: self._may_send(prompt_id))
            if prompt_id in self.quarantined:
                raise Quarantined(self.quarantined[prompt_id])
            self.in_flight[prompt_id] = self.in_flight.get(prompt_id, 0) + 1

    def _may_send(self, prompt_id: str) -> bool:
        if prompt_id in self.quarantined:
            return True
        if prompt_id in self.suspects:
            return not self.in_flight
        return not self.suspects

    async def sent(self, prompt_id: str) -> None:
        """``prompt_id``'s request came back (answered, failed or cancelled)."""
        async with self.changed:
            left = self.in_flight.get(prompt_id, 0) - 1
            if left > 0:
                self.in_flight[prompt_id] = left
            else:
                self.in_flight.pop(prompt_id, None)
            self.changed.notify_all()

    async def finished(self, prompt_id: str) -> None:
        """``prompt_id`` is done with (answered or failed for good): no longer a suspect."""
        async with self.changed:
            self.suspects.discard(prompt_id)
            self.changed.notify_all()


def quarantined_ids(errors_path: Path) -> dict[str, str]:
    """The prompts an earlier run quarantined (id → reason), from the dataset's errors file."""
    try:
        text = errors_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    found: dict[str, str] = {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("quarantined") is True and "id" in entry:
            found[str(entry["id"])] = str(entry.get("reason") or QUARANTINED_KIND)
    return found
