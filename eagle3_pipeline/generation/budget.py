"""Per-dataset token budgets: when to stop dispatching, and the bound on the overshoot.

A request is dispatched only while the tokens already counted plus the tokens expected from the
requests in flight stay below the budget (expected = the mean of the finished ones so far, or the
per-request maximum before any has finished). Requests in flight are never thrown away, so the
final count exceeds the budget by less than what those in flight at the last dispatch produced:
at most ``in-flight slots × the largest a request can count`` (``max_tokens`` per generated turn,
plus its prompt tokens when prompts count).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.config import GenerationConfig


def counted_tokens(record: Mapping[str, Any], counts: str) -> int:
    completion = int(record.get("completion_tokens") or 0)
    return completion + int(record.get("prompt_tokens") or 0) if counts == "prompt_and_completion" else completion


def record_bound(record: Mapping[str, Any], settings: GenerationConfig) -> int:
    """The most a finished record could count: ``max_tokens`` per generated turn (+ its prompt tokens)."""
    bound = settings.max_tokens * int(record.get("turns") or 1)
    if settings.budget_counts == "prompt_and_completion":
        bound += int(record.get("prompt_tokens") or 0)
    return bound


@dataclass(frozen=True)
class BudgetState:
    budget: int | None
    counts: str
    tokens: int
    overshoot_bound: int

    @property
    def reached(self) -> bool:
        return self.budget is not None and self.tokens >= self.budget

    @property
    def overshoot(self) -> int:
        return max(0, self.tokens - self.budget) if self.budget is not None else 0

    @property
    def within_bound(self) -> bool:
        return self.overshoot <= self.overshoot_bound

    def as_metadata(self) -> dict[str, Any]:
        return {
            "token_budget": self.budget,
            "budget_counts": self.counts,
            "budget_tokens": self.tokens,
            "budget_reached": self.reached,
            "budget_overshoot": self.overshoot,
            "budget_overshoot_bound": self.overshoot_bound,
        }


def budget_state(records: Iterable[Mapping[str, Any]], budget: int | None, settings: GenerationConfig) -> BudgetState:
    """The budget as the finished records stand. The bound is every in-flight slot of both length
    classes times the largest any of these records could have counted."""
    tokens, largest = 0, 0
    for record in records:
        tokens += counted_tokens(record, settings.budget_counts)
        largest = max(largest, record_bound(record, settings))
    return BudgetState(budget, settings.budget_counts, tokens, settings.concurrency.total * largest)


class TokenBudget:
    """Admission control for one run: ``admit`` before dispatching a request, ``settle`` after it."""

    def __init__(self, budget: int | None, counted: int, finished: int, first_guess: int) -> None:
        self.budget = budget
        self.counted = counted
        self._finished = finished
        self._first_guess = first_guess
        self._in_flight = 0
        self._settled = asyncio.Event()

    @property
    def exhausted(self) -> bool:
        return self.budget is not None and self.counted >= self.budget

    def _expected(self) -> float:
        return self.counted / self._finished if self._finished else float(self._first_guess)

    async def admit(self) -> bool:
        """True: dispatch one request (call ``settle`` when it ends). False: the budget is reached."""
        while self.budget is not None:
            if self.counted >= self.budget:
                return False
            if self.counted + self._in_flight * self._expected() < self.budget:
                break
            await self._settled.wait()
        self._in_flight += 1
        return True

    def settle(self, tokens: int | None) -> None:
        """The request ended: with ``tokens`` counted, or None if it produced no record."""
        self._in_flight -= 1
        if tokens is not None:
            self.counted += tokens
            self._finished += 1
        self._settled.set()
        self._settled = asyncio.Event()
