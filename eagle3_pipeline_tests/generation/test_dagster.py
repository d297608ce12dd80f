"""The `responses` asset and its budget check on a real Dagster instance, against a loopback
server reached as a hosted API with a key — and a scan proving that key appears in no log,
metadata, error text or file."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import dagster as dg
import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation import ResponseCheckpoint
from eagle3_pipeline.inference.provider import InferenceProvider
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply, echo_completion
from eagle3_pipeline_tests.dagster_runs import materialize_generation
from eagle3_pipeline_tests.pipeline_files import load_pipeline

SECRET = "sk-or-v1-test-0123456789abcdef-SECRET"
KEY_VAR = "EAGLE3_TEST_ROUTER_KEY"


def pipeline(folder: Path, server: FakeOpenAI, budget: int) -> PipelineConfig:
    """A keyed, priced endpoint (the loopback server) and dataset B1 of ten prompts under ``budget`` tokens."""
    write_jsonl(folder / "p.jsonl", [sharegpt(f"question {i}") for i in range(10)])
    endpoint = {
        "base_url": server.base_url,
        "api_key_env": KEY_VAR,
        "price": {"prompt_per_mtok": 1.0, "completion_per_mtok": 2.0},
    }
    generation = {
        "max_tokens": 8,
        "concurrency": {"short": 2, "long": 1},
        "progress_interval_s": 0.05,
        "fsync": "never",
        "retry": {"max_attempts": 2, "backoff_initial_s": 0.01},
        "length_estimator": "chars",  # the loopback server has no tokenizer
    }
    sections = {
        "name": "hosted",
        "target": {"model": "vendor/model", "tokenizer": "unused"},
        "inference": {"kind": "endpoints", "endpoints": [endpoint]},
        "generation": generation,
        "datasets": [{"id": "B1", "source": "p.jsonl", "token_budget": budget}],
    }
    return load_pipeline(folder, sections, runtime_checks=True)


def check_result(result: dg.ExecuteInJobResult) -> dg.AssetCheckEvaluation:
    [evaluation] = [e for e in result.get_asset_check_evaluations() if e.check_name == "token_budget"]
    return cast(dg.AssetCheckEvaluation, evaluation)


@pytest.fixture
def instance(monkeypatch: pytest.MonkeyPatch) -> dg.DagsterInstance:
    monkeypatch.setenv(KEY_VAR, SECRET)
    return dg.DagsterInstance.ephemeral()


def test_responses_metadata_and_the_budget_check(
    tmp_path: Path, fake_openai: FakeOpenAI, instance: dg.DagsterInstance
) -> None:
    result = materialize_generation(pipeline(tmp_path, fake_openai, budget=1000), instance)
    assert result.success
    [materialization] = [m for m in result.asset_materializations_for_node("responses")]
    metadata = {key: value.value for key, value in materialization.metadata.items()}
    assert (metadata["rows"], metadata["generated_now"], metadata["truncated"], metadata["failed"]) == (10, 10, 0, 0)
    assert metadata["latency_p50_s"] <= metadata["latency_p90_s"] <= metadata["latency_p99_s"]
    assert (metadata["token_budget"], metadata["budget_tokens"], metadata["budget_reached"]) == (1000, 50, False)
    assert metadata["cost_total"] == pytest.approx(10 * (11 * 1.0 + 5 * 2.0) / 1e6)
    assert metadata["throughput_series"].records and "tokens_per_s" in metadata["throughput_series"].records[0].data
    observations = [e for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"]
    assert observations, "progress ticks are recorded as observations the UI can plot"
    assert check_result(result).passed
    assert pq.read_table(tmp_path / "out" / "responses" / "B1.parquet").num_rows == 10

    sent = len(fake_openai.requests)
    again = materialize_generation(pipeline(tmp_path, fake_openai, budget=5), instance)
    evaluation = check_result(again)
    assert again.success and evaluation.passed, (
        "a budget lowered after generating: the table holds back what is over it"
    )
    [lowered] = [m for m in again.asset_materializations_for_node("responses")]
    assert (lowered.metadata["rows"].value, lowered.metadata["held_back_by_budget"].value) == (1, 9)
    assert len(ResponseCheckpoint(tmp_path / "out" / "responses" / "B1.checkpoint.jsonl").load()) == 10, (
        "nothing is deleted"
    )
    assert len(fake_openai.requests) == sent, "and nothing is sent"
    assert evaluation.severity == dg.AssetCheckSeverity.ERROR


def test_the_api_key_appears_in_no_log_metadata_error_or_file(
    tmp_path: Path,
    fake_openai: FakeOpenAI,
    instance: dg.DagsterInstance,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hosted API that echoes the key back in its error bodies (as some do), a failing run, then
    a successful one: the key is sent, and found nowhere else."""

    def echoing_server(body: dict[str, Any], n: int) -> Reply:
        text = body["messages"][-1]["content"]
        if text.endswith("1"):
            return Reply(status=400, payload={"error": {"message": f"bad request for key {SECRET}"}})
        if text.endswith("2"):
            return Reply(status=401, payload={"error": {"message": f"invalid key {SECRET}"}})
        if text.endswith("3"):
            return Reply(status=503, payload={"error": {"message": f"overloaded ({SECRET})"}})
        if text.endswith("4"):
            return Reply(status=200, payload={"error": {"message": f"upstream rejected {SECRET}", "code": 403}})
        return Reply(payload=echo_completion(body))

    caplog.set_level(logging.DEBUG)
    fake_openai.script = echoing_server
    config = pipeline(tmp_path, fake_openai, budget=1000)
    failed = materialize_generation(config, instance)
    assert not failed.success
    fake_openai.script = None
    succeeded = materialize_generation(config, instance)
    assert succeeded.success

    assert any(h.get("Authorization") == f"Bearer {SECRET}" for h in fake_openai.headers_seen), "the key was used"
    errors_file = (tmp_path / "out" / "responses" / "B1.errors.jsonl").read_text()
    assert "***" in errors_file and "HTTP 401" in errors_file and "error 403" in errors_file
    failure = next(e for e in failed.all_events if e.is_step_failure)
    texts = {
        "event log": "\n".join(
            dg.serialize_value(entry) for run in (failed, succeeded) for entry in instance.all_logs(run.run_id)
        ),
        "failure": str(failure.step_failure_data.error),
        "stdout+stderr": "".join(capfd.readouterr()),
        "python logging": caplog.text,
        "checkpoint": (tmp_path / "out" / "responses" / "B1.checkpoint.jsonl").read_text(),
        "errors file": errors_file,
        "responses table": str(pq.read_table(tmp_path / "out" / "responses" / "B1.parquet").to_pylist()),
        "config and endpoints": repr(config) + repr(InferenceProvider(config)._configured()),
    }
    assert "requests failed" in texts["failure"] and "B1" in texts["event log"]
    leaks = [where for where, text in texts.items() if SECRET in text or SECRET[10:30] in text]
    assert not leaks, f"the API key leaked into: {leaks}"
