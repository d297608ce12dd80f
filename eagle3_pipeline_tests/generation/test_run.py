"""Generation against a real loopback HTTP server; the checkpoint on real files.

The helpers (prompts, settings, a one-call `run`) are eagle3_pipeline.testing.generation_runs'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.generation import (
    CheckpointError,
    Endpoint,
    ResponseCheckpoint,
    generate,
    response_rows,
)
from eagle3_pipeline.records import PromptRecord, content_id, message
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply, echo_completion
from eagle3_pipeline.testing.generation_runs import lines, make_prompts, run, settings


def test_every_prompt_answered_and_checkpointed(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    prompts = make_prompts(12)
    summary = run(tmp_path, prompts, fake_openai)
    assert (summary.generated, summary.failed, summary.completion_tokens) == (12, 0, 60)
    stored = lines(tmp_path / "ck.jsonl")
    assert sorted(r["id"] for r in stored) == sorted(p.id for p in prompts)
    rows = response_rows(prompts, ResponseCheckpoint(tmp_path / "ck.jsonl").load())
    assert rows[0]["messages"][0] == message("user", "question 0")
    assert rows[0]["messages"][-1] == message("assistant", "echo: question 0", generated=True, finish_reason="stop")
    assert rows[0]["finish_reason"] == "stop" and rows[0]["latency_s"] >= 0 and rows[0]["turns"] == 1
    assert fake_openai.requests[0]["max_tokens"] == 8 and "tools" not in fake_openai.requests[0]


def test_rerun_skips_done_ids_without_contacting_a_server(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    prompts = make_prompts(5)
    run(tmp_path, prompts, fake_openai)

    def no_server() -> list[Endpoint]:
        raise AssertionError("a finished dataset must not start or contact a server")

    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl")
    summary = generate(
        prompts, no_server, settings=settings(), checkpoint=checkpoint, errors_path=tmp_path / "err.jsonl"
    )
    assert (summary.already_done, summary.generated) == (5, 0)
    assert len(fake_openai.requests) == 5


def test_torn_last_line_is_cut_and_redone(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    prompts = make_prompts(4)
    path = tmp_path / "ck.jsonl"
    run(tmp_path, prompts[:3], fake_openai)
    whole = path.read_bytes()
    last_start = whole.rstrip(b"\n").rfind(b"\n") + 1
    torn_id = json.loads(whole[last_start:])["id"]
    path.write_bytes(whole[: last_start + 25])
    assert torn_id not in ResponseCheckpoint(path).load(), "a reader ignores the torn line"
    assert path.read_bytes() == whole[: last_start + 25], "a reader never modifies the file"
    summary = run(tmp_path, prompts, fake_openai)
    assert summary.already_done == 2 and summary.generated == 2
    stored = [r["id"] for r in lines(path)]
    assert sorted(stored) == sorted(p.id for p in prompts) and torn_id in stored


def test_same_id_twice_is_stored_once(tmp_path: Path) -> None:
    path = tmp_path / "ck.jsonl"
    with ResponseCheckpoint(path).writer() as writer:
        writer.append({"id": "a", "response": "first"})
        writer.append({"id": "a", "response": "second"})
    assert ResponseCheckpoint(path).load() == {"a": {"id": "a", "response": "first"}}


def test_garbage_inside_the_checkpoint_is_refused_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "ck.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(CheckpointError, match=r"ck\.jsonl:2"):
        ResponseCheckpoint(path).load()


def test_a_second_writer_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ck.jsonl"
    with ResponseCheckpoint(path).writer(), pytest.raises(CheckpointError, match="another process is writing"):
        ResponseCheckpoint(path).writer()
    ResponseCheckpoint(path).writer().close()


@pytest.mark.parametrize("policy", ["never", "interval", "always"])
def test_every_fsync_policy_writes_each_record_at_once(tmp_path: Path, policy: str) -> None:
    path = tmp_path / "ck.jsonl"
    with ResponseCheckpoint(path, fsync=policy, fsync_interval_s=0.01).writer() as writer:  # type: ignore[arg-type]
        for i in range(3):
            writer.append({"id": str(i)})
            assert len(lines(path)) == i + 1, "on disk before the next answer arrives"


def test_non_openai_payload_counts_as_failure_without_retry(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script = lambda body, n: Reply(payload={"unexpected": True})
    summary = run(tmp_path, make_prompts(1), fake_openai)
    assert summary.failed == 1 and "not an OpenAI chat completion" in summary.error_examples[0]
    assert len(fake_openai.requests) == 1


def test_tool_schemas_are_sent_and_tool_calls_kept(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "find it"}]
    prompt = PromptRecord(content_id(messages, json.dumps(tools)), "B2", messages, json.dumps(tools), "short", 20, 0)
    call = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]
    fake_openai.script = lambda body, n: Reply(payload=echo_completion(body, content=None, tool_calls=call))
    run(tmp_path, [prompt], fake_openai)
    assert fake_openai.requests[0]["tools"] == tools
    record = lines(tmp_path / "ck.jsonl")[0]
    assert json.loads(record["response"]) == call, "the summary column shows the call"
    [row] = response_rows([prompt], ResponseCheckpoint(tmp_path / "ck.jsonl").load())
    answer = row["messages"][-1]
    assert answer["content"] is None and json.loads(answer["tool_calls"]) == call, "stored as the server returned it"
    assert (answer["generated"], answer["finish_reason"]) == (True, "stop")


def test_progress_reaches_each_sink_on_its_cadence_and_at_the_end(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    from eagle3_pipeline.cli.cmd_run import ProgressBar
    from eagle3_pipeline.generation import ProgressSink

    fake_openai.delay_s = 0.02
    often: list[Any] = []
    rarely: list[Any] = []
    sinks = [ProgressSink(0.05, often.append), ProgressSink(60, rarely.append)]
    summary = run(tmp_path, make_prompts(30), fake_openai, settings(concurrency={"short": 2, "long": 1}), sinks=sinks)
    assert len(often) > 2 and len(rarely) == 1, "the slow sink only gets the final snapshot"
    assert [p.done for p in often] == sorted(p.done for p in often)
    final = often[-1]
    assert (final.done, final.total, final.completion_tokens, final.failed, final.eta_s) == (30, 30, 150, 0, 0.0)
    assert final.tokens_per_s > 0 and "30/30 done" in final.line()
    assert any(p.eta_s and p.eta_s > 0 for p in often[:-1]), "an ETA while work remains"
    assert summary.series and {"elapsed_s", "tokens_per_s", "requests_per_s"} <= set(summary.series[-1])
    assert ProgressBar(None).render(final).startswith("B1 [" + "#" * ProgressBar.width + "] 30/30")
