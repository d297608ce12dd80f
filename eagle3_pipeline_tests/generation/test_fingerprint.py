"""The generation fingerprint on a real Dagster instance against a loopback server: a changed model
or max_tokens on an existing artifacts root is refused before anything is sent; `new_version` keeps
the old answers aside and regenerates; the UI's code/data versions and `partition_is_stale` follow."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation import ResponseCheckpoint, configured_fingerprint, partition_is_stale
from eagle3_pipeline.generation.fingerprint import GenerationFingerprint, endpoint_identity
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline_tests.dagster_runs import materialize_generation
from eagle3_pipeline_tests.pipeline_files import load_pipeline


def pipeline(
    folder: Path, server: FakeOpenAI, model: str = "org/target-a", max_tokens: int = 8, **generation: Any
) -> PipelineConfig:
    write_jsonl(folder / "p.jsonl", [sharegpt(f"question {i}") for i in range(6)])
    settings = {"max_tokens": max_tokens, "concurrency": 2, "fsync": "never", "length_estimator": "chars", **generation}
    sections = {
        "name": "fp",
        "target": {"model": model, "tokenizer": "unused"},
        "inference": {"kind": "endpoints", "endpoints": [{"base_url": server.base_url}]},
        "generation": settings,
        "datasets": [{"id": "B1", "source": "p.jsonl"}],
    }
    return load_pipeline(folder, sections, runtime_checks=True)


def fingerprint(config: PipelineConfig) -> GenerationFingerprint:
    return configured_fingerprint(config.generation, config.target, config.inference)


def stale(config: PipelineConfig, dataset_id: str) -> str | None:
    return partition_is_stale(config.artifacts_root, fingerprint(config), dataset_id)


def failure_text(result: dg.ExecuteInJobResult) -> str:
    failure = next(e for e in result.all_events if e.is_step_failure)
    data = failure.step_failure_data
    return data.user_failure_data.description if data.user_failure_data else str(data.error)


def generation_requests(server: FakeOpenAI) -> int:
    """Requests other than the 1-token probe every endpoint answers before a run starts."""
    return sum(1 for r in server.requests if r["max_tokens"] != 1)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model": "org/target-b"}, "model: checkpoint 'org/target-a', configured 'org/target-b'"),
        ({"max_tokens": 16}, "max_tokens: checkpoint 8, configured 16"),
    ],
)
def test_a_changed_fingerprint_is_refused_before_anything_is_sent(
    tmp_path: Path, fake_openai: FakeOpenAI, change: dict[str, Any], named: str
) -> None:
    instance = dg.DagsterInstance.ephemeral()
    assert materialize_generation(pipeline(tmp_path, fake_openai), instance).success
    answered = len(fake_openai.requests)
    checkpoint = (tmp_path / "out" / "responses" / "B1.checkpoint.jsonl").read_bytes()

    refused = materialize_generation(pipeline(tmp_path, fake_openai, **change), instance)
    text = failure_text(refused)
    print(f"\nrefusal: {text}\nrequests before: {answered}, after: {len(fake_openai.requests)}")
    assert not refused.success and named in text and "nothing was sent" in text
    assert len(fake_openai.requests) == answered, "0 requests sent, not even the endpoint probe"
    assert (tmp_path / "out" / "responses" / "B1.checkpoint.jsonl").read_bytes() == checkpoint


def test_new_version_keeps_the_old_answers_aside_and_regenerates(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    instance = dg.DagsterInstance.ephemeral()
    first_config = pipeline(tmp_path, fake_openai)
    first = materialize_generation(first_config, instance)
    assert first.success
    old_version = fingerprint(first_config).digest
    old_answers = (tmp_path / "out" / "responses" / "B1.checkpoint.jsonl").read_text()

    before = generation_requests(fake_openai)
    second_config = pipeline(tmp_path, fake_openai, model="org/target-b", on_fingerprint_change="new_version")
    assert stale(second_config, "B1") == (
        "stale: generation settings changed: model: checkpoint 'org/target-a', configured 'org/target-b'"
    )
    second = materialize_generation(second_config, instance)
    assert second.success
    regenerated = generation_requests(fake_openai) - before
    [kept] = list((tmp_path / "out" / "responses" / "previous").iterdir())
    print(
        f"\nnew_version: {regenerated} answers regenerated; "
        f"old answers kept in {kept}: {sorted(p.name for p in kept.iterdir())}"
    )
    assert regenerated == 6
    assert kept.name.startswith(f"B1.{old_version}-")
    assert (kept / "B1.checkpoint.jsonl").read_text() == old_answers, "the old answers are still on disk, untouched"
    assert {"B1.fingerprint.json", "B1.parquet"} <= {p.name for p in kept.iterdir()}
    models = {
        r["model"] for r in ResponseCheckpoint(tmp_path / "out" / "responses" / "B1.checkpoint.jsonl").load().values()
    }
    assert models == {"org/target-b"}
    assert stale(second_config, "B1") is None

    versions = [
        m.tags.get("dagster/code_version")
        for m in (
            first.asset_materializations_for_node("responses")[0],
            second.asset_materializations_for_node("responses")[0],
        )
    ]
    assert versions == [old_version, fingerprint(second_config).digest]
    first_data, second_data = (
        r.asset_materializations_for_node("responses")[0].tags["dagster/data_version"] for r in (first, second)
    )
    assert first_data != second_data and first_data.split(".")[1] == second_data.split(".")[1], (
        "same ids, other fingerprint: the data version changes in its fingerprint part"
    )
    stored = json.loads((tmp_path / "out" / "responses" / "B1.fingerprint.json").read_text())
    assert stored["endpoints"] == [endpoint_identity(fake_openai.base_url)]


def test_partition_is_stale_says_why(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    config = pipeline(tmp_path, fake_openai)
    assert stale(config, "B1") == "missing: no responses table yet"
    assert materialize_generation(config, dg.DagsterInstance.ephemeral()).success
    assert stale(config, "B1") is None
    assert "max_tokens: checkpoint 8, configured 9" in str(stale(pipeline(tmp_path, fake_openai, max_tokens=9), "B1"))
    (tmp_path / "out" / "responses" / "B1.fingerprint.json").unlink()
    assert "written before fingerprints were recorded" in str(stale(config, "B1"))


def test_several_endpoints_of_one_model_share_a_table_and_credentials_are_not_recorded(tmp_path: Path) -> None:
    assert (
        endpoint_identity("https://user:secret@router.example:8443/api/v1/?key=abc#x")
        == "https://router.example:8443/api/v1"
    )
    servers = [FakeOpenAI().start(), FakeOpenAI().start()]
    try:
        write_jsonl(tmp_path / "p.jsonl", [sharegpt(f"question {i}") for i in range(8)])
        sections = {
            "name": "two",
            "target": {"model": "org/target-a", "tokenizer": "unused"},
            "inference": {"kind": "endpoints", "endpoints": [{"base_url": s.base_url} for s in servers]},
            "generation": {"max_tokens": 8, "concurrency": 4, "length_estimator": "chars"},
            "datasets": [{"id": "B1", "source": "p.jsonl"}],
        }
        config = load_pipeline(tmp_path, sections, runtime_checks=True)
        result = materialize_generation(config, dg.DagsterInstance.ephemeral())
        assert result.success
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert checks["single_model"] and all(checks.values()), checks
        table = pq.read_table(tmp_path / "out" / "responses" / "B1.parquet", columns=["endpoint", "model"]).to_pylist()
        assert len({r["endpoint"] for r in table}) == 2 and {r["model"] for r in table} == {"org/target-a"}
    finally:
        for server in servers:
            server.stop()


def test_without_answers_new_settings_just_start_and_old_failures_are_kept_aside(
    tmp_path: Path, fake_openai: FakeOpenAI
) -> None:
    from eagle3_pipeline.testing.fake_openai import Reply

    fake_openai.script = lambda body, n: Reply(status=400) if body["max_tokens"] == 8 else Reply()
    instance = dg.DagsterInstance.ephemeral()
    assert not materialize_generation(pipeline(tmp_path, fake_openai), instance).success
    assert (tmp_path / "out" / "responses" / "B1.errors.jsonl").exists()
    assert materialize_generation(pipeline(tmp_path, fake_openai, max_tokens=16), instance).success, (
        "no answers to protect: no refusal"
    )
    [kept] = list((tmp_path / "out" / "responses" / "previous").iterdir())
    assert (kept / "B1.errors.jsonl").exists() and not (tmp_path / "out" / "responses" / "B1.errors.jsonl").exists()
