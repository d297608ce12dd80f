"""Several endpoints, concurrency per length class, keep-alive, cost, reasoning and multi-turn
regeneration — against real loopback servers."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.generation import Endpoint, GenerationFailed, Price
from eagle3_pipeline.records import PromptRecord, content_id
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply, echo_completion
from eagle3_pipeline.testing.generation_runs import lines, make_prompts, run, settings


@pytest.fixture
def second_server() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    yield server
    server.stop()


def test_least_outstanding_requests_favours_the_faster_endpoint(
    tmp_path: Path, fake_openai: FakeOpenAI, second_server: FakeOpenAI
) -> None:
    fake_openai.delay_s = 0.1
    endpoints = [Endpoint(fake_openai.base_url, "m"), Endpoint(second_server.base_url, "m")]
    summary = run(tmp_path, make_prompts(60), endpoints, settings(concurrency={"short": 4, "long": 1}))
    slow, fast = len(fake_openai.requests), len(second_server.requests)
    assert summary.generated == 60 and slow + fast == 60
    assert 0 < slow < fast
    assert [e["requests"] for e in summary.endpoints] == [slow, fast]
    stored = lines(tmp_path / "ck.jsonl")
    assert Counter(r["endpoint"] for r in stored) == {fake_openai.base_url: slow, second_server.base_url: fast}
    assert {r["model"] for r in stored} == {"m"}, "two endpoints of one model"


def test_an_endpoint_serving_another_model_stops_the_run_unwritten(
    tmp_path: Path, fake_openai: FakeOpenAI, second_server: FakeOpenAI
) -> None:
    """The fake server names the model it was asked for, so a second endpoint configured with
    another model stands for a server that serves a different one: its answer is not written."""
    fake_openai.delay_s = 0.05
    endpoints = [Endpoint(fake_openai.base_url, "model-a"), Endpoint(second_server.base_url, "model-b")]
    with pytest.raises(GenerationFailed, match="answered as model 'model-[ab]'.*not written"):
        run(tmp_path, make_prompts(20), endpoints, settings(concurrency={"short": 2, "long": 1}))
    assert len({r["model"] for r in lines(tmp_path / "ck.jsonl")}) == 1


def test_a_retry_moves_to_another_endpoint(tmp_path: Path, fake_openai: FakeOpenAI, second_server: FakeOpenAI) -> None:
    fake_openai.script = lambda body, n: Reply(status=502)
    endpoints = [Endpoint(fake_openai.base_url, "broken"), Endpoint(second_server.base_url, "ok")]
    summary = run(tmp_path, make_prompts(10), endpoints, settings(retry={"max_attempts": 2, "backoff_initial_s": 0.01}))
    assert (summary.generated, summary.failed) == (10, 0)
    assert {r["endpoint"] for r in lines(tmp_path / "ck.jsonl")} == {second_server.base_url}


def test_concurrency_is_bounded_per_length_class(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    active: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    lock = threading.Lock()

    def script(body: dict[str, Any], n: int) -> Reply:
        cls = body["messages"][-1]["content"].split()[0]
        with lock:
            active[cls] += 1
            peak[cls] = max(peak[cls], active[cls])
        time.sleep(0.05)
        with lock:
            active[cls] -= 1
        return Reply()

    fake_openai.script = script
    prompts = make_prompts(30, prefix="short") + make_prompts(12, length_class="long", prefix="long")
    run(tmp_path, prompts, fake_openai, settings(concurrency={"short": 5, "long": 2}))
    assert (peak["short"], peak["long"]) == (5, 2)


def test_connections_are_kept_alive(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    run(tmp_path, make_prompts(80), fake_openai, settings(concurrency={"short": 4, "long": 2}))
    assert len(fake_openai.requests) == 80 and len(fake_openai.connections) <= 4


def test_cost_comes_from_the_response_or_the_price_table(
    tmp_path: Path, fake_openai: FakeOpenAI, second_server: FakeOpenAI
) -> None:
    fake_openai.script = lambda body, n: Reply(
        payload=echo_completion(body, usage={"prompt_tokens": 11, "completion_tokens": 5, "cost": 0.25})
    )
    run(tmp_path / "a", make_prompts(2), [Endpoint(fake_openai.base_url, "m", price=Price(1.0, 1.0))])
    assert [r["cost"] for r in lines(tmp_path / "a" / "ck.jsonl")] == [0.25, 0.25], "the response's cost wins"
    run(tmp_path / "b", make_prompts(2), [Endpoint(second_server.base_url, "m", price=Price(2.0, 10.0))])
    assert [r["cost"] for r in lines(tmp_path / "b" / "ck.jsonl")] == [pytest.approx((11 * 2 + 5 * 10) / 1e6)] * 2
    summary = run(tmp_path / "c", make_prompts(1), [Endpoint(second_server.base_url, "m")])
    assert lines(tmp_path / "c" / "ck.jsonl")[0]["cost"] is None and summary.cost == 0


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
@pytest.mark.parametrize("policy", ["keep", "strip"])
def test_reasoning_is_kept_or_stripped(tmp_path: Path, fake_openai: FakeOpenAI, field: str, policy: str) -> None:
    reasoning: dict[str, Any] = {field: "let me think"}
    fake_openai.script = lambda body, n: Reply(payload=echo_completion(body, **reasoning))
    run(tmp_path, make_prompts(1), fake_openai, settings(reasoning=policy))
    [record] = lines(tmp_path / "ck.jsonl")
    assert record.get("reasoning") == ("let me think" if policy == "keep" else None)
    assert record["response"] == "echo: question 0"


def conversation() -> PromptRecord:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "old answer one"},
        {"role": "user", "content": "call the tool"},
        {"role": "assistant", "content": '[{"function": {"name": "lookup"}}]'},
        {"role": "tool", "content": "tool result"},
        {"role": "user", "content": "last question"},
    ]
    return PromptRecord(content_id(messages, None), "B1", messages, None, "short", 40, 0)


def test_multi_turn_regenerates_every_assistant_turn_on_the_regenerated_history(
    tmp_path: Path, fake_openai: FakeOpenAI
) -> None:
    from eagle3_pipeline.generation import ResponseCheckpoint, response_rows

    prompt = conversation()
    run(tmp_path, [prompt], fake_openai, settings(regenerate_turns="all"))
    first, final = fake_openai.requests
    assert [m["content"] for m in first["messages"]] == ["be brief", "first question"]
    assert final["messages"][2] == {"role": "assistant", "content": "echo: first question"}
    assert final["messages"][4]["content"] == '[{"function": {"name": "lookup"}}]', "a turn answered by a tool is kept"
    [record] = lines(tmp_path / "ck.jsonl")
    assert (record["turns"], record["completion_tokens"], record["prompt_tokens"]) == (2, 10, 22)
    [row] = response_rows([prompt], ResponseCheckpoint(tmp_path / "ck.jsonl").load())
    assert [m["content"] for m in row["messages"] if m["role"] == "assistant"] == [
        "echo: first question",
        '[{"function": {"name": "lookup"}}]',
        "echo: last question",
    ]


def test_last_turn_only_by_default(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    prompt = conversation()
    run(tmp_path, [prompt], fake_openai)
    [request] = fake_openai.requests
    assert request["messages"] == prompt.messages
    assert "history" not in lines(tmp_path / "ck.jsonl")[0]


def test_a_truncated_earlier_turn_marks_the_record_truncated(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script = lambda body, n: Reply(
        payload=echo_completion(body, finish_reason="length" if n == 1 else "stop")
    )
    summary = run(tmp_path, [conversation()], fake_openai, settings(regenerate_turns="all"))
    assert lines(tmp_path / "ck.jsonl")[0]["finish_reason"] == "length" and summary.truncated == 1
    assert json.loads(json.dumps(summary.as_metadata()))["truncated_now"] == 1


def test_every_configured_endpoint_is_probed_before_use(
    tmp_path: Path, fake_openai: FakeOpenAI, second_server: FakeOpenAI
) -> None:
    from eagle3_pipeline.serving import InferenceProvider
    from eagle3_pipeline.watch.monitor import UnhealthyError
    from eagle3_pipeline_tests.pipeline_files import load_pipeline

    (tmp_path / "p.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')

    def provider(urls: list[str]) -> InferenceProvider:
        price = {"prompt_per_mtok": 1, "completion_per_mtok": 3}
        sections = {
            "name": "two",
            "target": {"model": "m", "tokenizer": "t"},
            "inference": {"kind": "endpoints", "endpoints": [{"base_url": url, "price": price} for url in urls]},
            "datasets": [{"id": "B1", "source": "p.jsonl"}],
        }
        return InferenceProvider(load_pipeline(tmp_path, sections, runtime_checks=True))

    endpoints = provider([fake_openai.base_url, second_server.base_url]).endpoints()
    assert [e.base_url for e in endpoints] == [fake_openai.base_url, second_server.base_url]
    assert endpoints[0].price == Price(1.0, 3.0) and endpoints[0].model == "m"
    assert len(fake_openai.requests) == len(second_server.requests) == 1, "one 1-token probe each"
    second_server.script = lambda body, n: Reply(status=503)
    with pytest.raises(UnhealthyError, match=second_server.base_url) as caught:
        provider([fake_openai.base_url, second_server.base_url]).endpoints()
    assert fake_openai.base_url not in str(caught.value)
