"""Poison requests (generation/quarantine.py): the bookkeeping of suspects and quarantined prompts, the gate
that sends suspects one at a time and alone, the errors file a later run reads; and the engine end to end
against the scripted loopback server (FakeOpenAI: it stands in for a server that a poison prompt takes down —
its connections reset until the hook "restarts" it). The managed server's version is in
managed/test_recovery.py (SGLang stand-in) and real_vllm/test_recovery_policy_vllm.py (the real vLLM)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.generation import Endpoint, Recovered, ResponseCheckpoint, ServerRecovery, generate
from eagle3_pipeline.generation.quarantine import Quarantine, Quarantined, quarantined_ids
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply
from eagle3_pipeline.testing.generation_runs import lines, make_prompts, settings

PROMPTS = 30


def test_a_prompt_in_flight_at_two_crashes_is_quarantined_with_its_restarts() -> None:
    quarantine = Quarantine()
    assert quarantine.crashed(["a", "b", "c"], 1, "died: exited") == []
    assert quarantine.suspects == {"a", "b", "c"}
    assert quarantine.crashed(["b"], 2, "died: exited again") == ["b"]
    assert quarantine.suspects == {"a", "c"} and set(quarantine.quarantined) == {"b"}
    assert quarantine.quarantined["b"].startswith("quarantined: its request was in flight at 2 server crashes")
    assert "restarts 1 and 2" in quarantine.quarantined["b"] and "died: exited again" in quarantine.quarantined["b"]
    assert quarantine.crashed(["b"], 3, "again") == [], "quarantined once"


def test_suspects_go_one_at_a_time_and_alone_and_others_wait_for_them() -> None:
    async def scenario() -> list[str]:
        quarantine = Quarantine()
        order: list[str] = []
        await quarantine.turn("busy")  # a request in flight on another endpoint
        quarantine.crashed(["s1", "s2", "q"], 1, "died")
        quarantine.crashed(["q"], 2, "died")

        async def send(prompt_id: str) -> None:
            try:
                await quarantine.turn(prompt_id)
            except Quarantined as exc:
                order.append(f"{prompt_id}: {str(exc).split(':')[0]}")
                return
            order.append(f"{prompt_id} sent (in flight: {sorted(quarantine.in_flight)})")
            await asyncio.sleep(0)
            await quarantine.sent(prompt_id)
            await quarantine.finished(prompt_id)

        tasks = [asyncio.create_task(send(p)) for p in ("new", "s1", "s2", "q")]
        await asyncio.sleep(0.01)
        order.append("busy done")
        await quarantine.sent("busy")
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(scenario())
    assert order[0] == "q: quarantined", "a quarantined prompt is refused at once"
    assert order[1] == "busy done", "a suspect waits until nothing else is in flight"
    assert order[2:] == ["s1 sent (in flight: ['s1'])", "s2 sent (in flight: ['s2'])", "new sent (in flight: ['new'])"]


def test_a_later_run_reads_the_quarantined_prompts_from_the_errors_file(tmp_path: Path) -> None:
    errors = tmp_path / "B1.errors.jsonl"
    assert quarantined_ids(errors) == {}
    entries = [
        {"id": "a", "reason": "HTTP 400", "kind": "error"},
        {"id": "b", "reason": "quarantined: in flight at 2 crashes", "kind": "quarantined", "quarantined": True},
    ]
    errors.write_text("\n".join(json.dumps(e) for e in entries) + "\n{torn")
    assert quarantined_ids(errors) == {"b": "quarantined: in flight at 2 crashes"}


class PoisonServer:
    """A script for FakeOpenAI: a request holding ``marker`` takes the server down (that request and every
    one after it reset) until the hook ``recover`` restarts it; the others answer after ``delay_s``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.down = False
        self.restarts = 0
        self.lock = threading.Lock()

    def __call__(self, body: dict[str, Any], number: int) -> Reply:
        with self.lock:
            if self.marker == body["messages"][-1]["content"]:
                self.down = True
            if self.down:
                return Reply(reset=True)
        return Reply(delay_s=0.05)

    def recover(self, failure: str) -> Recovered:
        with self.lock:
            self.down = False
            self.restarts += 1
        restart = {"restart": self.restarts, "reason": "died: the poison", "duration_s": 0.0}
        return Recovered(True, "restarted", (restart,))


def test_a_poison_prompt_costs_two_restarts_then_is_quarantined_and_left_out_of_the_next_run(
    tmp_path: Path, fake_openai: FakeOpenAI
) -> None:
    prompts = make_prompts(PROMPTS)
    poison = prompts[7]
    script = PoisonServer(poison.messages[-1]["content"])
    fake_openai.script = script
    hook = ServerRecovery(frozenset({fake_openai.base_url}), script.recover)
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl", fsync="never")
    config = settings(retry={"max_attempts": 1}, max_consecutive_errors=1, concurrency={"short": 6, "long": 2})

    def run() -> Any:
        endpoint = Endpoint(fake_openai.base_url, "m")
        return generate(
            prompts,
            lambda: [endpoint],
            settings=config,
            checkpoint=checkpoint,
            errors_path=tmp_path / "err.jsonl",
            recovery=hook,
        )

    summary = run()
    ids = [r["id"] for r in lines(tmp_path / "ck.jsonl")]
    [error] = lines(tmp_path / "err.jsonl")
    assert error["id"] == poison.id and error["quarantined"] is True and error["kind"] == "quarantined"
    assert len(summary.restarts) == 2 and (summary.failed, summary.quarantined) == (1, 1)
    assert len(ids) == len(set(ids)) == PROMPTS - 1 and poison.id not in ids
    assert fake_openai.contents[poison.messages[-1]["content"]] == 2, "sent twice: at the crash and alone after it"
    metadata = summary.as_metadata()
    assert (metadata["quarantined_now"], metadata["failed"], metadata["server_restarts"]) == (1, 1, 2)

    again = run()
    assert (again.quarantined_earlier, again.generated, again.failed, again.restarts) == (1, 0, 0, [])
    assert again.as_metadata()["quarantined_earlier"] == 1
    assert fake_openai.contents[poison.messages[-1]["content"]] == 2, "never sent again"


@pytest.mark.parametrize("ordinary", [429, 400])
def test_a_quarantine_needs_a_restart(tmp_path: Path, fake_openai: FakeOpenAI, ordinary: int) -> None:
    """Failures that are no dead server (a 429, a 400) never make suspects: nothing is quarantined."""
    fake_openai.script = lambda body, number: Reply(status=ordinary) if number in (2, 3) else Reply()
    hook = ServerRecovery(frozenset({fake_openai.base_url}), lambda f: Recovered(True, "restarted"))
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl", fsync="never")
    summary = generate(
        make_prompts(10),
        lambda: [Endpoint(fake_openai.base_url, "m")],
        settings=settings(),
        checkpoint=checkpoint,
        errors_path=tmp_path / "err.jsonl",
        recovery=hook,
    )
    assert summary.quarantined == 0 and summary.restarts == []
