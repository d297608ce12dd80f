"""What a benchmark completion says about the τ measured on it: a degenerate loop, and its thinking/answer split.

A completion that falls into a short loop (its last tokens one short period repeated) is easy to draft, so it
inflates τ (tokenspeed #1305: 3.93 tokens per step on a loop vs 1.94 on chat): :func:`tail_loop` flags it and
the benchmark reports such requests apart instead of averaging them in.

A reasoning target's completion is thinking up to its end marker (``</think>``) and answer after it, as the
reasoning parsers split it (SGLang's and vLLM's ``kimi_k2``/``deepseek_r1``: everything before ``</think>`` is
reasoning, and with the start marker prefilled by the chat template a completion without ``</think>`` is all
reasoning): :func:`split_thinking`. The engines count verify steps per request, not per token, so the answer's
acceptance is measured on its own (greedy: the prompt plus the completion's thinking re-sent as the prompt gives
the same answer) and the thinking's is the whole completion's less the answer's (:func:`thinking_answer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class LoopFlag:
    """The last ``repeated_tokens`` tokens of a completion are a block of ``period`` tokens over and over."""

    period: int
    repeated_tokens: int

    @property
    def repeats(self) -> float:
        return self.repeated_tokens / self.period


def tail_loop(tokens: Sequence[int], min_tail: int = 32, max_period: int = 16, min_repeats: int = 3) -> LoopFlag | None:
    """The shortest period ``p <= max_period`` whose repetition covers the completion's last ``min_tail``
    tokens or more (at least ``min_repeats`` times), with how far back it reaches; None when there is none."""
    if min_tail < 1 or max_period < 1 or min_repeats < 2:
        raise ValueError("tail_loop: min_tail and max_period must be >= 1 and min_repeats >= 2")
    n = len(tokens)
    for period in range(1, max_period + 1):
        run = period  # the tail's last `period` tokens trivially repeat themselves
        while run < n and tokens[n - 1 - run] == tokens[n - 1 - run + period]:
            run += 1
        if run >= max(min_tail, min_repeats * period):
            return LoopFlag(period, run)
    return None


def _find(haystack: Sequence[int], needle: Sequence[int], start: int = 0) -> int:
    """The first index >= ``start`` where ``needle`` occurs in ``haystack``; -1 when it does not."""
    width = len(needle)
    for i in range(start, len(haystack) - width + 1):
        if list(haystack[i : i + width]) == list(needle):
            return i
    return -1


def _rfind(haystack: Sequence[int], needle: Sequence[int]) -> int:
    width = len(needle)
    for i in range(len(haystack) - width, -1, -1):
        if list(haystack[i : i + width]) == list(needle):
            return i
    return -1


def thinking_open(prompt: Sequence[int], start: Sequence[int], end: Sequence[int]) -> bool:
    """Whether the prompt leaves the model thinking: its last start marker comes after its last end marker
    (the chat template prefilled ``<think>``, as Kimi-K2.5's does)."""
    return _rfind(prompt, start) > _rfind(prompt, end) if start else False


def split_thinking(
    prompt: Sequence[int], completion: Sequence[int], start: Sequence[int], end: Sequence[int]
) -> int | None:
    """How many of the completion's leading tokens are thinking (the end marker included), as the reasoning
    parser splits it; None when the completion has no thinking at all (neither prefilled nor opened)."""
    if not end:
        raise ValueError("split_thinking: the end marker has no token ids")
    opened = thinking_open(prompt, start, end) or (bool(start) and list(completion[: len(start)]) == list(start))
    if not opened:
        return None
    closed = _find(completion, end)
    return len(completion) if closed < 0 else closed + len(end)


@dataclass(frozen=True)
class PartAcceptance:
    """One part's completion tokens and verify steps: τ = tokens / steps (None with no step)."""

    tokens: int
    verify_steps: int

    @property
    def tau(self) -> float | None:
        return self.tokens / self.verify_steps if self.verify_steps > 0 else None


def thinking_answer(
    whole_tokens: int, whole_steps: int, answer_tokens: int, answer_steps: int
) -> tuple[PartAcceptance, PartAcceptance]:
    """Thinking and answer acceptance from the whole completion's figures and the answer's measured on its own
    (the prompt plus the thinking re-sent as the prompt, greedy): the thinking part is the difference."""
    if answer_tokens > whole_tokens or answer_steps > whole_steps:
        raise ValueError(
            f"the answer measured alone ({answer_tokens} tokens, {answer_steps} verify steps) exceeds the whole "
            f"completion ({whole_tokens}, {whole_steps}): the greedy re-run diverged"
        )
    thinking = PartAcceptance(whole_tokens - answer_tokens, whole_steps - answer_steps)
    return thinking, PartAcceptance(answer_tokens, answer_steps)
