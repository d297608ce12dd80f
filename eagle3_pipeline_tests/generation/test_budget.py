"""Per-dataset token budgets: dispatching stops at the budget, the overshoot stays within what the
requests in flight can add, and a finished budget needs no server."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

from eagle3_pipeline.generation import Endpoint, ResponseCheckpoint, budget_state, generate
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply, echo_completion
from eagle3_pipeline.testing.generation_runs import lines, make_prompts, run, settings


def sized_answers(sizes: random.Random, delay_s: float = 0.0) -> Any:
    """A script answering with random completion sizes (1..8 tokens) after a random short delay."""
    lock = threading.Lock()

    def script(body: dict[str, Any], n: int) -> Reply:
        with lock:
            tokens = sizes.randint(1, 8)
            delay = sizes.uniform(0, delay_s)
        answer = echo_completion(body, completion_tokens=tokens, finish_reason="length" if tokens == 8 else "stop")
        return Reply(delay_s=delay, payload=answer)

    return script


def test_budget_stops_dispatch_with_bounded_overshoot(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script = sized_answers(random.Random(3), delay_s=0.03)
    config = settings(concurrency={"short": 8, "long": 2})
    summary = run(tmp_path, make_prompts(300), fake_openai, config, token_budget=200)
    records = lines(tmp_path / "ck.jsonl")
    state = budget_state(records, 200, config)
    assert state.reached and state.tokens == sum(r["completion_tokens"] for r in records)
    assert state.overshoot <= state.overshoot_bound == (8 + 2) * 8
    assert summary.skipped_by_budget == 300 - len(records) > 200
    assert len(fake_openai.requests) == len(records), "nothing was dispatched and thrown away"


def test_the_worst_case_overshoot_is_the_requests_in_flight(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    """Small answers first make the expected size small, so many requests are in flight when the
    long ones arrive: the overshoot is then large, but still within slots × max_tokens."""
    fake_openai.script = lambda body, n: Reply(
        delay_s=0.0 if n <= 8 else 0.05, payload=echo_completion(body, completion_tokens=1 if n <= 8 else 8)
    )
    config = settings(concurrency={"short": 6, "long": 1})
    run(tmp_path, make_prompts(100), fake_openai, config, token_budget=20)
    state = budget_state(lines(tmp_path / "ck.jsonl"), 20, config)
    assert 0 < state.overshoot <= state.overshoot_bound == 7 * 8


def test_prompt_and_completion_tokens_can_both_count(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    config = settings(budget_counts="prompt_and_completion", concurrency={"short": 1, "long": 1})
    summary = run(tmp_path, make_prompts(20), fake_openai, config, token_budget=64)
    assert summary.generated == 4, "11 prompt + 5 completion tokens each: the 4th reaches 64"
    state = budget_state(lines(tmp_path / "ck.jsonl"), 64, config)
    assert (state.tokens, state.overshoot, state.overshoot_bound) == (64, 0, 2 * (8 + 11))


def test_a_reached_budget_needs_no_server_and_a_raised_one_resumes(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    prompts = make_prompts(30)
    config = settings(concurrency={"short": 1, "long": 1})
    first = run(tmp_path, prompts, fake_openai, config, token_budget=25)
    assert first.generated == 5 and first.skipped_by_budget == 25

    def no_server() -> list[Endpoint]:
        raise AssertionError("a dataset whose budget is reached must not contact a server")

    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl")
    again = generate(
        prompts, no_server, settings=config, checkpoint=checkpoint, errors_path=tmp_path / "err.jsonl", token_budget=25
    )
    assert (again.already_done, again.generated, again.skipped_by_budget) == (5, 0, 25)

    raised = run(tmp_path, prompts, fake_openai, config, token_budget=50)
    assert (raised.already_done, raised.generated) == (5, 5)
    assert len({r["id"] for r in lines(tmp_path / "ck.jsonl")}) == 10


def test_progress_reports_the_budget(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    from eagle3_pipeline.generation import ProgressSink

    seen: list[Any] = []
    config = settings(concurrency={"short": 1, "long": 1})
    run(tmp_path, make_prompts(10), fake_openai, config, token_budget=20, sinks=[ProgressSink(10, seen.append)])
    final = seen[-1]
    assert (final.budget_tokens, final.token_budget, final.fraction) == (20, 20, 1.0)
    assert "budget 20/20" in final.line()
