"""Empty answers are failures, prompts that cannot fit are never sent, and every blocking check on
`responses` can fail — and be repaired by a rerun — against a loopback server and a real Dagster
instance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation.length import check_lengths
from eagle3_pipeline.generation.quality import account_for_prompts
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.records import PromptRecord, content_id, message
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply, echo_completion
from eagle3_pipeline.testing.generation_runs import lines, make_prompts, run, settings
from eagle3_pipeline_tests.pipeline_files import load_pipeline


def test_an_empty_answer_is_retried_then_failed_never_stored(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    """A reasoning model that spent max_tokens thinking: reasoning, no content. Retried, then the
    errors file; an answer with only tool calls is not empty."""
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]

    def script(body: dict[str, Any], n: int) -> Reply:
        text = body["messages"][-1]["content"]
        if text.endswith(" 0"):
            return Reply(
                payload=echo_completion(body, finish_reason="length", content=None, reasoning_content="Let me think...")
            )
        if text.endswith(" 1"):
            return Reply(payload=echo_completion(body, content="  \n", reasoning_content="hmm"))
        if text.endswith(" 2"):
            return Reply(payload=echo_completion(body, finish_reason="tool_calls", content=None, tool_calls=call))
        return Reply(payload=echo_completion(body))

    fake_openai.script = script
    summary = run(
        tmp_path, make_prompts(4), fake_openai, settings(retry={"max_attempts": 3, "backoff_initial_s": 0.01})
    )
    assert (summary.generated, summary.failed, summary.empty) == (2, 2, 2)
    stored = {r["response"] for r in lines(tmp_path / "ck.jsonl")}
    assert stored == {json.dumps(call), "echo: question 3"}, "no empty answer is written"
    errors = lines(tmp_path / "err.jsonl")
    assert {(e["kind"], e["attempts"]) for e in errors} == {("empty", 3)}
    assert "empty answer" in errors[0]["reason"] and "finish_reason" in errors[0]["reason"]
    assert len(fake_openai.requests) == 3 + 3 + 1 + 1


def pipeline(folder: Path, server: FakeOpenAI, questions: int = 10, **generation: Any) -> PipelineConfig:
    write_jsonl(folder / "p.jsonl", [sharegpt(f"question {i}") for i in range(questions)])
    settings_ = {
        "max_tokens": 8,
        "concurrency": 2,
        "fsync": "never",
        "length_estimator": "chars",
        "retry": {"max_attempts": 2, "backoff_initial_s": 0.01},
        **generation,
    }
    sections = {
        "name": "q",
        "target": {"model": "m", "tokenizer": "unused", "max_seq_len": 64},
        "inference": {"kind": "endpoints", "endpoints": [{"base_url": server.base_url}]},
        "generation": settings_,
        "datasets": [{"id": "B1", "source": "p.jsonl"}],
    }
    return load_pipeline(folder, sections, runtime_checks=True)


def materialize(config: PipelineConfig, selection: list[str] | None = None) -> dg.ExecuteInJobResult:
    defs = build_definitions(config)
    assets: Any = list(defs.assets or [])
    return dg.materialize(
        assets,
        selection=selection or ["prompts", "responses"],
        partition_key="B1",
        instance=dg.DagsterInstance.ephemeral(),
        resources=defs.resources,
        raise_on_error=False,
    )


def checks(result: dg.ExecuteInJobResult) -> dict[str, tuple[bool, str]]:
    return {e.check_name: (e.passed, str(e.description)) for e in result.get_asset_check_evaluations()}


def test_a_failed_empty_answers_check_is_repaired_by_a_rerun(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.script = lambda body, n: Reply(
        payload=echo_completion(body, content=None)
        if body["messages"][-1]["content"] in {"question 3", "question 7"}
        else echo_completion(body)
    )
    config = pipeline(tmp_path, fake_openai, max_failed_fraction=0.5, max_empty_rate=0.1)
    failed = materialize(config)
    verdicts = checks(failed)
    print(f"\nfirst run: empty_answers {verdicts['empty_answers']}")
    assert not failed.success and verdicts["empty_answers"] == (
        False,
        "2 of 10 prompts sent are left with an empty answer (20.0%; limit 10.0%), e.g. "
        + ", ".join(
            sorted(p.id for p in make_b1_prompts(config) if p.messages[-1]["content"] in {"question 3", "question 7"})
        )
        + "; a rerun retries them (a reasoning model may need a larger max_tokens)",
    )
    assert verdicts["prompts_accounted"][0], "the two failed prompts are accounted for"

    fake_openai.script = None
    repaired = materialize(config)
    print(f"rerun: {checks(repaired)['empty_answers']}")
    assert repaired.success and all(passed for passed, _ in checks(repaired).values()), checks(repaired)
    assert [m.metadata["generated_now"].value for m in repaired.asset_materializations_for_node("responses")] == [2]


def make_b1_prompts(config: PipelineConfig) -> list[PromptRecord]:
    from eagle3_pipeline.records import read_prompts

    return read_prompts(ArtifactLayout(config.artifacts_root).prompts("B1"))


def test_prompts_that_cannot_fit_are_not_sent_and_are_listed(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    config = pipeline(tmp_path, fake_openai)
    write_jsonl(tmp_path / "p.jsonl", [sharegpt("short question"), sharegpt("word " * 200), sharegpt("another one")])
    result = materialize(config)
    assert result.success, checks(result)
    [mat] = result.asset_materializations_for_node("responses")
    metadata = {k: v.value for k, v in mat.metadata.items()}
    long_id = next(p.id for p in make_b1_prompts(config) if p.messages[-1]["content"].startswith("word"))
    print(
        f"\nover length: {metadata['skipped_over_length']} skipped ({metadata['over_length_ids']}), "
        f"estimator {metadata['length_estimator']}"
    )
    assert (metadata["skipped_over_length"], metadata["over_length_ids"], metadata["rows"]) == (1, [long_id], 2)
    assert metadata["length_estimator"] == "chars/4"
    assert not any(r["messages"][-1]["content"].startswith("word") for r in fake_openai.requests), "never sent"
    assert checks(result)["prompts_accounted"] == (
        True,
        "3 prompts: 2 answered, 0 failed, 1 over length, budget not reached",
    )


def test_prompts_accounted_fails_on_changed_prompts_and_a_rerun_repairs_it(
    tmp_path: Path, fake_openai: FakeOpenAI
) -> None:
    config = pipeline(tmp_path, fake_openai, questions=6)
    assert materialize(config).success
    write_jsonl(tmp_path / "p.jsonl", [sharegpt(f"question {i}") for i in range(2, 9)])
    assert materialize(config, ["prompts"]).success
    layout = ArtifactLayout(config.artifacts_root)
    stale = account_for_prompts(layout, "B1", None, config.generation)
    print(f"\nprompts changed under the table: {stale.verdict()}")
    assert not stale.consistent and (len(stale.orphans), len(stale.unaccounted)) == (2, 3)
    again = materialize(config, ["responses"])
    assert again.success and checks(again)["prompts_accounted"][0]
    assert account_for_prompts(layout, "B1", None, config.generation).consistent


def test_the_regenerated_conversation_is_stored_as_the_server_returned_it(
    tmp_path: Path, fake_openai: FakeOpenAI
) -> None:
    """regenerate_turns=all: every generated assistant turn is in the row with generated=True, its
    finish_reason and (reasoning: keep) its reasoning; the source's own turns stay generated=False."""
    from eagle3_pipeline.generation import ResponseCheckpoint, response_rows

    messages = [message("user", "first"), message("assistant", "old answer"), message("user", "second")]
    prompt = PromptRecord(content_id(messages, None), "B1", messages, None, "short", 10, 0)
    fake_openai.script = lambda body, n: Reply(payload=echo_completion(body, reasoning_content=f"thought {n}"))
    run(tmp_path, [prompt], fake_openai, settings(regenerate_turns="all"))
    [row] = response_rows([prompt], ResponseCheckpoint(tmp_path / "ck.jsonl").load())
    assert [m["generated"] for m in row["messages"]] == [False, True, False, True]
    assert row["messages"][1] == message(
        "assistant", "echo: first", reasoning_content="thought 1", generated=True, finish_reason="stop"
    )
    assert row["messages"][3]["content"] == "echo: second" and row["turns"] == 2
    assert fake_openai.requests[1]["messages"][1] == {"role": "assistant", "content": "echo: first"}, (
        "sent back without pipeline fields"
    )


@pytest.mark.local_model
def test_the_target_tokenizer_estimates_prompt_lengths(local_model: Path) -> None:
    prompts = make_prompts(2) + [
        PromptRecord(
            content_id([message("user", "x " * 3000)], None),
            "B1",
            [message("user", "x " * 3000)],
            None,
            "long",
            1500,
            2,
        )
    ]
    fit = check_lengths(
        prompts, max_seq_len=2048, max_tokens=128, estimator="tokenizer", tokenizer_name=str(local_model)
    )
    assert fit.estimator == f"tokenizer:{local_model}" and fit.fallbacks == 0
    assert [p.id for p in fit.over_length] == [prompts[2].id] and len(fit.fits) == 2
    assert 3000 <= fit.longest <= 3100, "the chat template's tokens, not 4 characters a token"


def test_a_prompt_quarantined_earlier_is_not_sent_and_counts_against_max_failed_fraction(
    tmp_path: Path, fake_openai: FakeOpenAI
) -> None:
    """The errors file's quarantined line (as a run that found the prompt in flight at two crashes writes it,
    generation/quarantine.py) is read by the next run: not sent, counted as failed."""
    fake_openai.script = lambda body, n: (
        Reply(status=400) if body["messages"][-1]["content"] == "question 3" else Reply()
    )
    first = materialize(pipeline(tmp_path, fake_openai, max_failed_fraction=0.5))
    assert first.success, checks(first)
    errors = ArtifactLayout(tmp_path / "out").errors("B1")
    [failed] = lines(errors)
    reason = "quarantined: its request was in flight at 2 server crashes (restarts 1 and 2; ...)"
    errors.write_text(json.dumps({**failed, "reason": reason, "kind": "quarantined", "quarantined": True}) + "\n")
    sent = len(fake_openai.requests)

    refused = materialize(pipeline(tmp_path, fake_openai, max_failed_fraction=0.0))
    failure = next(e for e in refused.all_events if e.is_step_failure)
    assert not refused.success and "1 of 10 requests failed (allowed: 0; quarantined: 1)" in str(
        failure.event_specific_data
    )
    kept = materialize(pipeline(tmp_path, fake_openai, max_failed_fraction=0.5))
    assert kept.success, checks(kept)
    [mat] = kept.asset_materializations_for_node("responses")
    assert (mat.metadata["quarantined_earlier"].value, mat.metadata["generated_now"].value) == (1, 0)
    assert len(fake_openai.requests) == sent, "the quarantined prompt was never sent again"
