"""The loop flag and the thinking/answer split. The reasoning completion is a fixture rendered by the tiny
Kimi-K2.5 stand-in's real chat template and tokenizer (``<think>`` prefilled by the generation prompt), not a
generation by Kimi."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_pipeline.drafter.serve.completion_checks import (
    THINK_END,
    THINK_START,
    LoopFlag,
    split_thinking,
    tail_loop,
    thinking_answer,
)
from eagle3_pipeline.target.folder import load_tokenizer


def test_a_tail_that_repeats_a_short_period_is_flagged_and_chat_is_not() -> None:
    chat = list(range(100, 160))
    loop = [*chat[:20], *([7, 8, 9] * 14)]
    assert tail_loop(chat) is None
    assert tail_loop(loop) == LoopFlag(period=3, repeated_tokens=42)
    assert tail_loop([5] * 40) == LoopFlag(1, 40)
    # Too short a tail: the same loop over fewer than min_tail tokens is not flagged.
    assert tail_loop([*chat[:20], *([7, 8, 9] * 5)]) is None
    # A period longer than max_period is not a degenerate loop here.
    assert tail_loop(list(range(20)) * 3, max_period=16) is None
    assert tail_loop(list(range(20)) * 3, max_period=20) == LoopFlag(20, 60)


def test_bad_thresholds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_repeats"):
        tail_loop([1, 2], min_repeats=1)


def test_a_reasoning_completion_splits_at_the_end_marker(kimi_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(str(kimi_checkpoint), trust_remote_code=True)
    prompt_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    assert str(prompt_text).endswith(THINK_START)  # Kimi-K2.5's template prefills <think>
    prompt = tokenizer(str(prompt_text), add_special_tokens=False)["input_ids"]
    start = tokenizer(THINK_START, add_special_tokens=False)["input_ids"]
    end = tokenizer(THINK_END, add_special_tokens=False)["input_ids"]
    assert len(start) == len(end) == 1  # special tokens, as in the real vocabulary
    thinking = tokenizer("The user adds two and two. That is four.", add_special_tokens=False)["input_ids"]
    answer = tokenizer("The answer is 4.", add_special_tokens=False)["input_ids"]
    completion = [*thinking, *end, *answer]
    cut = split_thinking(prompt, completion, start, end)
    assert cut is not None and cut == len(thinking) + 1
    assert tokenizer.decode(completion[cut:]) == "The answer is 4."
    # Unfinished thinking is all thinking; without a prefilled or opened <think> there is none.
    assert split_thinking(prompt, thinking, start, end) == len(thinking)
    assert split_thinking(answer, answer, start, end) is None
    assert split_thinking(answer, [*start, *thinking, *end, *answer], start, end) == len(thinking) + 2
    # The acceptance of each part: the answer measured alone, the thinking the rest.
    think_part, answer_part = thinking_answer(30, 12, 10, 5)
    assert (think_part.tokens, think_part.verify_steps, answer_part.tau) == (20, 7, 2.0)
    print(
        f"thinking/answer split: {cut} thinking tokens, {len(completion) - cut} answer tokens; "
        f"thinking τ {think_part.tau:.3f}, answer τ {answer_part.tau:.3f}"
    )


def test_an_answer_rerun_longer_than_the_whole_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="greedy re-run diverged"):
        thinking_answer(10, 5, 11, 5)
