"""What is left of a dataset to generate, and what that costs on a price table: the arithmetic the
planner and `generation.failover` share."""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle3_pipeline.generation.endpoints import Price

UNKNOWN = "unknown"


@dataclass(frozen=True)
class Workload:
    """What is left of one dataset: prompts, completion and prompt tokens, and how that was worked out."""

    dataset: str
    pending: int | None
    answers: int
    completion_left: int | None
    prompt_left: int | None
    basis: str


def estimate_left(
    dataset: str,
    *,
    pending: int,
    answers: int,
    completion_done: int,
    prompt_done: int,
    budget_left: int | None,
    counts: str,
    bound_per_prompt: float,
    prompt_per_prompt: float,
) -> Workload:
    """Completion tokens left: the pending prompts times the mean completion per answer so far (with
    no answer yet, ``max_tokens`` per generated turn: an upper bound), capped by the budget left
    (counted in budget units, converted to completion tokens by the answers' share of them)."""
    if answers:
        per_completion, per_prompt = completion_done / answers, prompt_done / answers
        basis = f"{pending} pending × {per_completion:.1f} completion tokens per answer"
    else:
        per_completion, per_prompt = bound_per_prompt, prompt_per_prompt
        basis = f"{pending} pending × {per_completion:.0f} (max_tokens per turn; no answer yet: an upper bound)"
    completion_left = pending * per_completion
    if budget_left is not None:
        share = 1.0
        if counts == "prompt_and_completion":
            total = (completion_done + prompt_done) if answers else (per_completion + per_prompt)
            share = (completion_done if answers else per_completion) / total if total else 1.0
        by_budget = max(0, budget_left) * share
        if by_budget < completion_left:
            completion_left = by_budget
            basis = f"token budget: {max(0, budget_left)} {counts.replace('_', ' ')} tokens left"
    prompts_sent = min(pending, math.ceil(completion_left / per_completion)) if per_completion > 0 else pending
    return Workload(dataset, pending, answers, round(completion_left), round(prompts_sent * per_prompt), basis)


def cost_of(price: Price | None, prompt_tokens: int | None, completion_tokens: int | None) -> float | None:
    """The price table's cost of these tokens; None (unknown, not 0) without a price or a count."""
    if price is None or prompt_tokens is None or completion_tokens is None:
        return None
    return price.cost(prompt_tokens, completion_tokens)
