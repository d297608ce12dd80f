"""What one generation run did (:class:`GenerationSummary`, the figures its asset shows) and the ways it
stops short (:class:`GenerationFailed` and its kinds), apart from the engine in :mod:`.runner`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationSummary:
    """What one run did; ``as_metadata`` holds only numbers and texts that are safe to show."""

    dataset: str
    total: int
    token_budget: int | None
    already_done: int = 0
    generated: int = 0
    failed: int = 0
    retries: int = 0
    truncated: int = 0
    usage_estimated: int = 0
    skipped_by_budget: int = 0
    empty: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    counted_now: int = 0
    cost: float = 0.0
    elapsed_s: float = 0.0
    series: list[dict[str, float]] = field(default_factory=list)
    endpoints: list[dict[str, Any]] = field(default_factory=list)
    error_examples: list[str] = field(default_factory=list)
    failovers: list[dict[str, Any]] = field(default_factory=list)
    moved_in_flight: int = 0
    restarts: list[dict[str, Any]] = field(default_factory=list)
    resent_after_restart: int = 0
    quarantined: int = 0  # prompts quarantined in this run (in `failed` too)
    quarantined_earlier: int = 0  # prompts an earlier run quarantined, not sent

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_metadata(self) -> dict[str, Any]:
        return {
            "prompts": self.total,
            "already_done": self.already_done,
            "generated_now": self.generated,
            "failed": self.failed,
            "retries": self.retries,
            "truncated_now": self.truncated,
            "usage_estimated_now": self.usage_estimated,
            "skipped_by_budget": self.skipped_by_budget,
            "empty_answers_failed_now": self.empty,
            "new_completion_tokens": self.completion_tokens,
            "new_prompt_tokens": self.prompt_tokens,
            "new_cost": round(self.cost, 6),
            "generation_seconds": round(self.elapsed_s, 2),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "endpoints": self.endpoints,
            "failover_decisions": self.failovers,
            "requests_moved_by_failover": self.moved_in_flight,
            "server_restarts": len(self.restarts),
            "restarts": self.restarts,
            "requests_resent_after_restart": self.resent_after_restart,
            "quarantined_now": self.quarantined,
            "quarantined_earlier": self.quarantined_earlier,
        }


class GenerationFailed(RuntimeError):
    """Generation stopped or left too many prompts unanswered; finished answers are checkpointed."""

    def __init__(self, message: str, summary: GenerationSummary) -> None:
        super().__init__(message)
        self.summary = summary


class ModelChanged(GenerationFailed):
    """An endpoint answered as another model than the dataset's other answers."""


class ServerLost(GenerationFailed):
    """The server died or hung and could not be brought back (:class:`~.recovery.RecoveryFailed`)."""
