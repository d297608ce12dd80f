"""Progress snapshots of a generation run, and the sinks that receive them on their own cadence."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    dataset: str
    done: int
    total: int
    generated: int
    failed: int
    retries: int
    truncated: int
    completion_tokens: int
    budget_tokens: int
    token_budget: int | None
    elapsed_s: float
    eta_s: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def fraction(self) -> float:
        by_prompts = self.done / self.total if self.total else 1.0
        if self.token_budget:
            return max(by_prompts, min(1.0, self.budget_tokens / self.token_budget))
        return by_prompts

    def line(self) -> str:
        budget = f", budget {self.budget_tokens}/{self.token_budget}" if self.token_budget else ""
        return (
            f"{self.dataset}: {self.done}/{self.total} done, {self.completion_tokens} new tokens, "
            f"{self.tokens_per_s:.1f} tok/s, {self.failed} failed, {self.retries} retries, "
            f"{self.truncated} truncated{budget}, ETA {format_duration(self.eta_s)}"
        )


@dataclass(frozen=True)
class ProgressSink:
    """Something that wants a :class:`Progress` every ``every_s`` seconds, and once at the end."""

    every_s: float
    emit: Callable[[Progress], None]


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def eta_s(remaining: int, rate: float, budget_left: int | None, token_rate: float) -> float | None:
    """Seconds left: the remaining prompts at the current request rate, or the remaining budget at
    the current token rate, whichever ends first; None while there is no rate to go by."""
    if remaining == 0:
        return 0.0
    estimates = []
    if rate > 0:
        estimates.append(remaining / rate)
    if budget_left is not None and token_rate > 0:
        estimates.append(max(0, budget_left) / token_rate)
    return min(estimates) if estimates else None
