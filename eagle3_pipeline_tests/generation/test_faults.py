"""Retries and failures against a real loopback server scripted to misbehave: 429 with
Retry-After, bursts of 500, hangs, truncated JSON, connection resets, slow answers, truncation by
max_tokens, refused requests, and a server that is down."""

from __future__ import annotations

import random
import socket
from collections import Counter
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.config import RetryConfig
from eagle3_pipeline.generation import Endpoint, GenerationFailed
from eagle3_pipeline.generation.retry import backoff_s, parse_retry_after
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply, echo_completion
from eagle3_pipeline.testing.generation_runs import lines, make_prompts, run, settings


def first_attempt_per_prompt(misbehaviour: Reply) -> Any:
    """A script: the first request for each prompt misbehaves, the next one is answered."""
    seen: Counter[str] = Counter()

    def script(body: dict[str, Any], n: int) -> Reply:
        content = body["messages"][-1]["content"]
        seen[content] += 1
        return misbehaviour if seen[content] == 1 else Reply()

    return script


def request_times(fake: FakeOpenAI) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    for body, at in zip(fake.requests, fake.times, strict=True):
        times.setdefault(body["messages"][-1]["content"], []).append(at)
    return times


def test_429_waits_for_retry_after(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script = first_attempt_per_prompt(Reply(status=429, headers={"Retry-After": "1"}))
    config = settings(retry={"max_attempts": 3, "backoff_initial_s": 0.01, "backoff_max_s": 5})
    summary = run(tmp_path, make_prompts(2), fake_openai, config)
    assert (summary.generated, summary.failed, summary.retries) == (2, 0, 2)
    for first, second in request_times(fake_openai).values():
        assert second - first >= 0.95, "the client waited as long as Retry-After asked"
    assert {r["finish_reason"] for r in lines(tmp_path / "ck.jsonl")} == {"stop"}


def test_a_burst_of_500_is_retried_away(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script = lambda body, n: Reply(status=500) if n <= 6 else Reply()
    summary = run(tmp_path, make_prompts(10), fake_openai)
    assert (summary.generated, summary.failed, summary.retries) == (10, 0, 6)
    assert not (tmp_path / "err.jsonl").exists()


@pytest.mark.parametrize(
    "misbehaviour",
    [
        pytest.param(Reply(hang=True), id="hang"),
        pytest.param(Reply(truncate_to=40), id="truncated-json"),
        pytest.param(Reply(reset=True), id="connection-reset"),
        pytest.param(
            Reply(status=200, payload={"error": {"message": "upstream overloaded", "code": 503}}), id="error-in-200"
        ),
    ],
)
def test_transient_failures_are_retried(tmp_path: Path, fake_openai: FakeOpenAI, misbehaviour: Reply) -> None:
    fake_openai.script = first_attempt_per_prompt(misbehaviour)
    summary = run(tmp_path, make_prompts(3), fake_openai, settings(read_timeout_s=0.3))
    assert (summary.generated, summary.failed, summary.retries) == (3, 0, 3)
    assert sorted(Counter(b["messages"][-1]["content"] for b in fake_openai.requests).values()) == [2, 2, 2]


def test_slow_answers_within_the_read_timeout_are_waited_for(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.delay_s = 0.2
    summary = run(tmp_path, make_prompts(4), fake_openai, settings(read_timeout_s=2))
    assert (summary.generated, summary.retries) == (4, 0)
    assert min(r["latency_s"] for r in lines(tmp_path / "ck.jsonl")) >= 0.2


def test_finish_reason_length_is_counted_as_truncation(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    def script(body: dict[str, Any], n: int) -> Reply:
        cut = body["messages"][-1]["content"].endswith(("1", "3"))
        return Reply(
            payload=echo_completion(body, completion_tokens=8 if cut else 5, finish_reason="length" if cut else "stop")
        )

    fake_openai.script = script
    seen: list[Any] = []
    summary = run(tmp_path, make_prompts(5), fake_openai, sinks=[_sink(seen)])
    assert (summary.generated, summary.truncated) == (5, 2)
    assert seen[-1].truncated == 2 and "2 truncated" in seen[-1].line()
    assert sorted(r["finish_reason"] for r in lines(tmp_path / "ck.jsonl")) == [
        "length",
        "length",
        "stop",
        "stop",
        "stop",
    ]


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_client_errors_are_not_retried(tmp_path: Path, fake_openai: FakeOpenAI, status: int) -> None:
    fake_openai.script = lambda body, n: Reply(status=status)
    summary = run(tmp_path, make_prompts(2), fake_openai)
    assert (summary.generated, summary.failed, summary.retries) == (0, 2, 0)
    assert len(fake_openai.requests) == 2
    errors = lines(tmp_path / "err.jsonl")
    assert [(e["status"], e["attempts"], e["retryable"]) for e in errors] == [(status, 1, False)] * 2
    assert all(f"HTTP {status}" in e["reason"] for e in errors)


def test_retries_are_bounded_and_the_failure_is_recorded(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script = lambda body, n: Reply(status=503, payload={"error": {"message": "warming up"}})
    summary = run(tmp_path, make_prompts(1), fake_openai)
    assert (summary.failed, len(fake_openai.requests)) == (1, 4)
    [error] = lines(tmp_path / "err.jsonl")
    assert (error["attempts"], error["status"], error["retryable"]) == (4, 503, True)
    assert "warming up" in error["reason"] and error["id"] == make_prompts(1)[0].id


def test_consecutive_errors_stop_the_run(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script = lambda body, n: Reply(status=500)
    config = settings(
        max_consecutive_errors=3,
        concurrency={"short": 2, "long": 1},
        retry={"max_attempts": 2, "backoff_initial_s": 0.01},
    )
    with pytest.raises(GenerationFailed, match="3 requests in a row failed") as caught:
        run(tmp_path, make_prompts(50), fake_openai, config)
    assert "server is probably down" in str(caught.value)
    failed = caught.value.summary.failed
    assert 3 <= failed <= 3 + 1, "only a request already in flight may fail after the stop"
    assert len(fake_openai.requests) <= (3 + 2) * 2, "it stopped instead of burning through the dataset"
    assert len(lines(tmp_path / "err.jsonl")) == failed and not lines(tmp_path / "ck.jsonl")


def test_a_server_that_is_down_stops_the_run(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = settings(max_consecutive_errors=2, retry={"max_attempts": 2, "backoff_initial_s": 0.01})
    with pytest.raises(GenerationFailed, match="in a row failed") as caught:
        run(tmp_path, make_prompts(20), [Endpoint(f"http://127.0.0.1:{port}/v1", "m")], config)
    assert "ConnectError" in str(caught.value)


def test_missing_usage_is_estimated_and_flagged(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script = lambda body, n: Reply(payload=echo_completion(body, usage={}))
    summary = run(tmp_path, make_prompts(1), fake_openai)
    [record] = lines(tmp_path / "ck.jsonl")
    assert record["usage_estimated"] is True and record["completion_tokens"] == 4  # "echo: question 0" / 4
    assert record["prompt_tokens"] > 0 and summary.usage_estimated == 1


def test_backoff_is_jittered_exponential_capped_and_honours_retry_after() -> None:
    policy = RetryConfig(max_attempts=8, backoff_initial_s=1.0, backoff_max_s=10.0)
    rng = random.Random(7)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (6, 10.0)]:
        delays = [backoff_s(attempt, policy, None, rng) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays) and len(set(delays)) > 1
    assert backoff_s(1, policy, 5.0, rng) == 5.0
    assert backoff_s(1, policy, 600.0, rng) == 10.0, "no single wait exceeds backoff_max_s"


def test_retry_after_as_seconds_or_http_date() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    now = 1_700_000_000.0
    assert parse_retry_after(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30, abs=1)


def _sink(seen: list[Any]) -> Any:
    from eagle3_pipeline.generation import ProgressSink

    return ProgressSink(0.05, seen.append)
