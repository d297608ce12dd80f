"""`generation.failover`: one backend at a time, and when to move a dataset to the next one.

The run sends every request to the current backend. It moves on when the dataset's ETA there
(completion tokens left over the rate the current backend has delivered since it became current)
would pass the deadline, or when ``unhealthy_after_errors`` attempts in a row failed on it (a
probe of a backend that went silent counts as an attempt). Each
move is one JSON line in ``responses/<dataset>.failover.jsonl`` with the numbers behind it; the
runner cancels the requests still in flight on the old backend and sends each again, once, to the
new one (an answer is written only when its request returns, so no id is answered twice).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import EndpointConfig, GenerationConfig, InferenceConfig
from eagle3_pipeline.config.pipeline import failover_order
from eagle3_pipeline.generation.endpoints import Endpoint
from eagle3_pipeline.generation.estimate import UNKNOWN, Workload, cost_of
from eagle3_pipeline.generation.fingerprint import endpoint_identity


def endpoint_label(entry: EndpointConfig) -> str:
    """How the planner and the failover records name an endpoint: its ``name``, else its base URL
    without credentials."""
    return entry.name or endpoint_identity(entry.base_url)


@dataclass(frozen=True)
class FailoverSettings:
    """The configured failover of one dataset's run, before its endpoints are resolved."""

    dataset: str
    order: list[int]  # indices into the resolved endpoints (= inference.endpoints)
    names: list[str]
    deadline_at: float | None  # epoch seconds
    check_every_s: float
    unhealthy_after: int
    log_path: Path
    probe_timeout_s: float | None = None

    @classmethod
    def from_config(
        cls,
        generation: GenerationConfig,
        inference: InferenceConfig,
        dataset_id: str,
        log_path: Path,
        now: float | None = None,
    ) -> FailoverSettings | None:
        failover = generation.failover
        if failover is None:
            return None
        start = time.time() if now is None else now
        deadline = (
            start + failover.deadline_s
            if failover.deadline_s is not None
            else failover.deadline.timestamp()
            if failover.deadline
            else None
        )
        order = failover_order(failover, inference.endpoints)
        names = [endpoint_label(inference.endpoints[i]) for i in order]
        return cls(
            dataset_id,
            order,
            names,
            deadline,
            failover.check_every_s,
            failover.unhealthy_after_errors,
            log_path,
            failover.probe_timeout_s,
        )


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


class Failover:
    """Which backend is current, what it has delivered since it became current, and the moves."""

    def __init__(self, settings: FailoverSettings, endpoints: Sequence[Endpoint]) -> None:
        if max(settings.order) >= len(endpoints):
            raise ValueError(
                f"generation.failover names endpoint {max(settings.order)}, but the run has {len(endpoints)} "
                "endpoint(s): failover needs the pipeline file's inference.endpoints (not a base_url override)"
            )
        self.settings = settings
        self.endpoints = [endpoints[i] for i in settings.order]
        self.position = 0
        self.since = time.monotonic()
        self.tokens = 0
        self.answers = 0
        self.failed_in_a_row = 0
        self.answers_at_last_check = 0
        self.decisions: list[dict[str, Any]] = []

    @property
    def current(self) -> Endpoint:
        return self.endpoints[self.position]

    @property
    def name(self) -> str:
        return self.settings.names[self.position]

    @property
    def has_next(self) -> bool:
        return self.position + 1 < len(self.endpoints)

    def answered(self, endpoint: Endpoint, completion_tokens: int) -> None:
        if endpoint is self.current:
            self.tokens += completion_tokens
            self.answers += 1
            self.failed_in_a_row = 0

    def attempt_failed(self, endpoint: Endpoint) -> bool:
        """Count a failed attempt; True when the current backend has now failed too often in a row."""
        if endpoint is not self.current:
            return False
        self.failed_in_a_row += 1
        return self.has_next and self.failed_in_a_row >= self.settings.unhealthy_after

    def silent_since_last_check(self) -> bool:
        """No answer from the current backend since the previous call."""
        silent = self.answers == self.answers_at_last_check
        self.answers_at_last_check = self.answers
        return silent

    def rate(self) -> float | None:
        """Completion tokens per second the current backend delivered since it became current."""
        elapsed = time.monotonic() - self.since
        return self.tokens / elapsed if self.answers and elapsed > 0 else None

    def past_deadline(self, work: Workload) -> bool:
        """Whether finishing on the current backend at its measured rate would pass the deadline.
        False (undecided) without a deadline, a next backend, or a rate measured over at least one
        ``check_every_s`` with an answer in it."""
        if self.settings.deadline_at is None or not self.has_next or work.completion_left is None:
            return False
        rate = self.rate()
        if rate is None or time.monotonic() - self.since < self.settings.check_every_s:
            return False
        return time.time() + work.completion_left / rate > self.settings.deadline_at

    def move(
        self, reason: str, work: Workload, rate: float | None, eta: float | None, sent: int, moved_in_flight: int
    ) -> dict[str, Any]:
        """Make the next backend current and record why, with the numbers (JSON line + the decision)."""
        old, old_name = self.current, self.name
        self.position += 1
        now = time.time()
        deadline = self.settings.deadline_at

        def cost(endpoint: Endpoint) -> float | str:
            value = cost_of(endpoint.price, work.prompt_left, work.completion_left)
            return round(value, 6) if value is not None else UNKNOWN

        decision = {
            "at": _iso(now),
            "dataset": self.settings.dataset,
            "from": old_name,
            "to": self.name,
            "reason": reason,
            "tokens_per_s": round(rate, 2) if rate is not None else UNKNOWN,
            "completion_tokens_left": work.completion_left if work.completion_left is not None else UNKNOWN,
            "tokens_left_basis": work.basis,
            "eta_s": round(eta, 1) if eta is not None else UNKNOWN,
            "deadline": _iso(deadline) if deadline is not None else None,
            "seconds_to_deadline": round(deadline - now, 1) if deadline is not None else None,
            "failed_attempts_in_a_row": self.failed_in_a_row,
            "answers_from_old_backend_this_run": self.answers,
            "requests_sent_to_old_backend": sent,
            "in_flight_moved": moved_in_flight,
            "cost_left_on_old_usd": cost(old),
            "cost_left_on_new_usd": cost(self.current),
        }
        self.since, self.tokens, self.answers, self.failed_in_a_row, self.answers_at_last_check = (
            time.monotonic(),
            0,
            0,
            0,
            0,
        )
        self.decisions.append(decision)
        self.settings.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.settings.log_path.open("a", encoding="utf-8") as log:
            log.write(json.dumps(decision) + "\n")
        return decision
