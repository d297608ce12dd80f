"""Generation against a real loopback HTTP server; the checkpoint on real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.generation import (
    CheckpointError,
    Endpoint,
    GenerationSettings,
    ResponseCheckpoint,
    generate,
    response_rows,
)
from eagle3_pipeline.records import PromptRecord, content_id
from eagle3_pipeline_tests.fake_openai import FakeOpenAI, echo_completion

SETTINGS = GenerationSettings(max_tokens=8, concurrency=4, request_timeout_s=5, connect_timeout_s=2)


def make_prompts(n: int, dataset: str = "B1") -> list[PromptRecord]:
    prompts = []
    for i in range(n):
        messages = [{"role": "user", "content": f"question {i}"}]
        prompts.append(PromptRecord(content_id(messages, None), dataset, messages, None, "short", 5, i))
    return prompts


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_prompt_answered_and_checkpointed(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    prompts = make_prompts(12)
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl")
    summary = generate(prompts, lambda: Endpoint(fake_openai.base_url, "m"), SETTINGS, checkpoint, tmp_path / "err.jsonl")
    assert (summary.generated, summary.failed, summary.completion_tokens) == (12, 0, 60)
    stored = lines(tmp_path / "ck.jsonl")
    assert sorted(r["id"] for r in stored) == sorted(p.id for p in prompts)
    rows = response_rows(prompts, checkpoint.load())
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": "echo: question 0"}
    assert rows[0]["finish_reason"] == "stop" and rows[0]["latency_s"] >= 0


def test_rerun_skips_done_ids_without_contacting_a_server(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    prompts = make_prompts(5)
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl")
    generate(prompts, lambda: Endpoint(fake_openai.base_url, "m"), SETTINGS, checkpoint, tmp_path / "e.jsonl")

    def no_server() -> Endpoint:
        raise AssertionError("a finished dataset must not start or contact a server")

    summary = generate(prompts, no_server, SETTINGS, checkpoint, tmp_path / "e.jsonl")
    assert (summary.already_done, summary.generated) == (5, 0)
    assert len(fake_openai.requests) == 5


def test_torn_last_line_is_cut_and_redone(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    prompts = make_prompts(4)
    path = tmp_path / "ck.jsonl"
    generate(prompts[:3], lambda: Endpoint(fake_openai.base_url, "m"), SETTINGS, ResponseCheckpoint(path), tmp_path / "e")
    whole = path.read_bytes()
    last_start = whole.rstrip(b"\n").rfind(b"\n") + 1
    torn_id = json.loads(whole[last_start:])["id"]
    path.write_bytes(whole[: last_start + 25])
    summary = generate(prompts, lambda: Endpoint(fake_openai.base_url, "m"), SETTINGS, ResponseCheckpoint(path), tmp_path / "e")
    assert summary.already_done == 2 and summary.generated == 2
    stored = [r["id"] for r in lines(path)]
    assert sorted(stored) == sorted(p.id for p in prompts) and torn_id in stored


def test_same_id_twice_is_stored_once(tmp_path: Path) -> None:
    path = tmp_path / "ck.jsonl"
    checkpoint = ResponseCheckpoint(path)
    checkpoint.append({"id": "a", "response": "first"})
    checkpoint.append({"id": "a", "response": "second"})
    assert checkpoint.load() == {"a": {"id": "a", "response": "first"}}


def test_garbage_inside_the_checkpoint_is_refused_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "ck.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(CheckpointError, match=r"ck\.jsonl:2"):
        ResponseCheckpoint(path).load()


def test_failures_are_recorded_without_the_api_key(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    secret = "sk-test-secret-4242"
    fake_openai.script = lambda body, n: (500, None) if "question 1" in body["messages"][-1]["content"] else (200, echo_completion(body))
    prompts = make_prompts(3)
    summary = generate(prompts, lambda: Endpoint(fake_openai.base_url, "m", secret), SETTINGS, ResponseCheckpoint(tmp_path / "ck.jsonl"), tmp_path / "err.jsonl")
    assert (summary.generated, summary.failed) == (2, 1)
    assert "HTTP 500" in summary.error_examples[0]
    assert fake_openai.headers_seen[0]["Authorization"] == f"Bearer {secret}"
    assert secret not in (tmp_path / "err.jsonl").read_text() + repr(summary) + repr(Endpoint("u", "m", secret))
    assert secret not in (tmp_path / "ck.jsonl").read_text()


def test_non_openai_payload_counts_as_failure(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script = lambda body, n: (200, {"unexpected": True})
    summary = generate(make_prompts(1), lambda: Endpoint(fake_openai.base_url, "m"), SETTINGS, ResponseCheckpoint(tmp_path / "ck"), tmp_path / "e")
    assert summary.failed == 1 and "not an OpenAI chat completion" in summary.error_examples[0]


def test_concurrency_is_bounded(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    import threading

    active, peak, lock = [0], [0], threading.Lock()

    def script(body: dict, n: int) -> tuple[int, dict]:
        import time

        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return 200, echo_completion(body)

    fake_openai.script = script
    generate(make_prompts(20), lambda: Endpoint(fake_openai.base_url, "m"), SETTINGS, ResponseCheckpoint(tmp_path / "ck"), tmp_path / "e")
    assert 1 < peak[0] <= SETTINGS.concurrency
