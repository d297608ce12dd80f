"""The generation engine's recovery hook (generation/recovery.py) against the scripted loopback server
(FakeOpenAI: it stands in for a server that dies — its connections reset — and comes back when the hook
"restarts" it; the managed server's own hook is tested in managed/test_recovery.py and, with a kill -9 of a
real vLLM, in real_vllm/test_recovery_vllm.py): one shared recovery for every failed request, the failed
and in-flight requests sent again without counting as retries or errors, 0 lost and 0 duplicated answers,
a recovery that gives up stopping the run, and an HTTP 5xx checked as a dead server's answer."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.generation import (
    Endpoint,
    Recovered,
    RecoveryFailed,
    ResponseCheckpoint,
    ServerLost,
    ServerRecovery,
    generate,
)
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply
from eagle3_pipeline.testing.generation_runs import lines, make_prompts, settings

PROMPTS = 40


class DyingServer:
    """A script for FakeOpenAI: request ``die_at`` finds the server dead (its connection reset, and every
    request after it until the hook restarts it); the ``hang`` requests before it never answer (in flight
    when it dies). ``recover`` is the hook: it counts its calls and brings the server back."""

    def __init__(self, die_at: int, hang: tuple[int, ...] = (), restart: bool = True, pause_s: float = 0.3) -> None:
        self.die_at = die_at
        self.hang = hang
        self.restart = restart
        self.pause_s = pause_s
        self.down = False
        self.calls: list[str] = []
        self.hung: list[str] = []  # the last user turns of the requests left hanging
        self.lock = threading.Lock()

    def __call__(self, body: dict[str, Any], number: int) -> Reply:
        with self.lock:
            if number == self.die_at:
                self.down = True
            if self.down:
                return Reply(reset=True)
            if number in self.hang:
                self.hung.append(body["messages"][-1]["content"])
                return Reply(hang=True)
        return Reply()

    def recover(self, failure: str) -> Recovered:
        self.calls.append(failure)
        time.sleep(self.pause_s)  # the other failing requests arrive meanwhile and wait for this one
        if not self.restart:
            return Recovered(False, "the server serves")
        with self.lock:
            self.down = False
        restart = {"restart": len(self.calls), "reason": "died", "duration_s": self.pause_s}
        return Recovered(True, "restarted", (restart,))


def run_with(tmp_path: Path, fake: FakeOpenAI, script: DyingServer, **overrides: Any):
    endpoint = Endpoint(fake.base_url, "m")
    fake.script = script
    hook = ServerRecovery(frozenset({fake.base_url}), script.recover)
    config = settings(**overrides)
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl", fsync="never")
    return generate(
        make_prompts(PROMPTS),
        lambda: [endpoint],
        settings=config,
        checkpoint=checkpoint,
        errors_path=tmp_path / "err.jsonl",
        recovery=hook,
    )


def test_a_server_that_dies_is_recovered_once_and_no_answer_is_lost_or_written_twice(
    tmp_path: Path, fake_openai: FakeOpenAI
) -> None:
    script = DyingServer(die_at=10, hang=(8, 9))
    # One attempt per request and one failure stops the run: the restart's resends count as neither.
    summary = run_with(tmp_path, fake_openai, script, retry={"max_attempts": 1}, max_consecutive_errors=1)

    assert [call.split(" ")[0] for call in script.calls] == ["ReadError"], "one recovery, for a reset connection"
    assert (summary.generated, summary.failed, summary.retries) == (PROMPTS, 0, 0)
    assert summary.restarts == [{"restart": 1, "reason": "died", "duration_s": 0.3}]
    assert summary.resent_after_restart >= 3, "the request that found it dead and the two in flight (hanging)"
    ids = [r["id"] for r in lines(tmp_path / "ck.jsonl")]
    assert len(ids) == len(set(ids)) == PROMPTS and set(ids) == {p.id for p in make_prompts(PROMPTS)}
    assert len(script.hung) == 2 and all(fake_openai.contents[turn] == 2 for turn in script.hung)
    metadata = summary.as_metadata()
    assert (
        metadata["server_restarts"] == 1 and metadata["requests_resent_after_restart"] == summary.resent_after_restart
    )


def test_a_server_found_serving_leaves_the_failure_an_ordinary_one(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    script = DyingServer(die_at=5, restart=False, pause_s=0.0)

    def heal(body: dict[str, Any], number: int) -> Reply:
        reply = script(body, number)
        script.down = False  # one reset, then it answers
        return reply

    fake_openai.script = heal
    hook = ServerRecovery(frozenset({fake_openai.base_url}), script.recover)
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl", fsync="never")
    summary = generate(
        make_prompts(PROMPTS),
        lambda: [Endpoint(fake_openai.base_url, "m")],
        settings=settings(),
        checkpoint=checkpoint,
        errors_path=tmp_path / "err.jsonl",
        recovery=hook,
    )
    assert len(script.calls) == 1 and summary.restarts == []
    assert (summary.generated, summary.retries, summary.resent_after_restart) == (PROMPTS, 1, 0)


def test_failures_that_are_not_a_dead_server_never_call_the_hook(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script = lambda body, number: Reply(status=429) if number in (3, 4) else Reply()
    calls: list[str] = []
    hook = ServerRecovery(frozenset({fake_openai.base_url}), lambda f: calls.append(f) or Recovered(False, ""))
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl", fsync="never")
    summary = generate(
        make_prompts(10),
        lambda: [Endpoint(fake_openai.base_url, "m")],
        settings=settings(),
        checkpoint=checkpoint,
        errors_path=tmp_path / "e",
        recovery=hook,
    )
    assert calls == [] and summary.retries == 2 and summary.generated == 10


def test_an_http_5xx_asks_the_hook_whether_the_server_died(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    """vLLM answers 500 to the requests in flight when its engine dies, then exits: a 5xx is checked."""
    fake_openai.script = lambda body, number: Reply(status=500) if number == 3 else Reply()
    calls: list[str] = []
    hook = ServerRecovery(frozenset({fake_openai.base_url}), lambda f: calls.append(f) or Recovered(False, "serves"))
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl", fsync="never")
    summary = generate(
        make_prompts(10),
        lambda: [Endpoint(fake_openai.base_url, "m")],
        settings=settings(),
        checkpoint=checkpoint,
        errors_path=tmp_path / "e",
        recovery=hook,
    )
    assert len(calls) == 1 and calls[0].startswith("HTTP 500 from ")
    assert (summary.retries, summary.generated, summary.restarts) == (1, 10, [])


def test_a_recovery_that_gives_up_stops_the_run_with_its_message(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    script = DyingServer(die_at=12)

    def give_up(failure: str) -> Recovered:
        script.calls.append(failure)
        time.sleep(0.2)
        failed = [{"restart": n, "outcome": "failed: exited during start-up"} for n in (1, 2)]
        raise RecoveryFailed("the managed server failed again after 2 restart(s); log /x.log, last lines:\nOOM", failed)

    fake_openai.script = script
    hook = ServerRecovery(frozenset({fake_openai.base_url}), give_up)
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl", fsync="never")
    with pytest.raises(ServerLost) as caught:
        generate(
            make_prompts(PROMPTS),
            lambda: [Endpoint(fake_openai.base_url, "m")],
            settings=settings(),
            checkpoint=checkpoint,
            errors_path=tmp_path / "err.jsonl",
            recovery=hook,
        )
    message = str(caught.value)
    assert message.startswith("B1: the managed server failed again after 2 restart(s)") and "OOM" in message
    assert f"The {caught.value.summary.generated} answers of this run are checkpointed" in message
    assert len(script.calls) == 1, "one recovery for every request that failed on the dead server"
    assert [r["restart"] for r in caught.value.summary.restarts] == [1, 2], "the failed restarts are recorded"
    ids = [r["id"] for r in lines(tmp_path / "ck.jsonl")]
    assert len(ids) == len(set(ids)) == caught.value.summary.generated >= 8
