"""The planner (`eagle3-pipeline plan`) and `generation.failover`, against two real loopback
OpenAI-compatible servers of different speeds and prices.

The fake servers stand in for real backends (a slow cheap box and a fast dear hosted API): each
answers 5 completion tokens after `token_delay_s` per token. Speeds differ 100-fold, so which one is
faster is never a close call; the tests assert rankings and decisions, never durations.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.config import ConfigError, PipelineConfig, load_config
from eagle3_pipeline.generation import DatasetResult, Endpoint, Price, ResponseCheckpoint, generate_dataset
from eagle3_pipeline.generation.estimate import cost_of, estimate_left
from eagle3_pipeline.generation.failover import FailoverSettings
from eagle3_pipeline.inference.provider import endpoints_from_config
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.records import (
    PROMPT_SCHEMA,
    PromptRecord,
    prompt_rows,
    write_parquet,
)
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply
from eagle3_pipeline.testing.generation_runs import lines, make_prompts
from eagle3_pipeline_tests.cli_runs import plan_cli
from eagle3_pipeline_tests.dagster_runs import materialize_generation
from eagle3_pipeline_tests.pipeline_files import load_pipeline, write_pipeline

SECRET = "sk-fast-0123456789abcdef-PLANNER-SECRET"
KEY_VAR = "EAGLE3_TEST_FAST_KEY"


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(KEY_VAR, SECRET)
    slow = FakeOpenAI(token_delay_s=0.1).start()  # 0.5 s an answer
    fast = FakeOpenAI(token_delay_s=0.001).start()  # 5 ms an answer
    yield slow, fast
    slow.stop()
    fast.stop()


def two_backends(folder: Path, slow: FakeOpenAI, fast: FakeOpenAI, unpriced: str | None = None) -> dict[str, Any]:
    """Pipeline sections for two priced endpoints (the fast one keyed), an unpriced third where given, quick
    generation settings, and dataset B1 of one prompt (``p.jsonl``)."""
    endpoints: list[dict[str, Any]] = [
        {"name": "slow-box", "base_url": slow.base_url, "price": {"prompt_per_mtok": 0.1, "completion_per_mtok": 0.2}},
        {
            "name": "fast-api",
            "base_url": fast.base_url,
            "api_key_env": KEY_VAR,
            "price": {"prompt_per_mtok": 1.0, "completion_per_mtok": 2.0},
        },
    ]
    if unpriced:
        endpoints.append({"name": "no-price", "base_url": unpriced})
    generation: dict[str, Any] = {
        "max_tokens": 8,
        "concurrency": {"short": 2, "long": 1},
        "connect_timeout_s": 2,
        "read_timeout_s": 5,
        "retry": {"max_attempts": 6, "backoff_initial_s": 0.01, "backoff_max_s": 0.05},
        "fsync": "never",
        "progress_interval_s": 0.05,
        "length_estimator": "chars",
    }
    (folder / "p.jsonl").write_text('{"conversations": [{"from": "human", "value": "hello"}]}\n')
    return {
        "name": "planner",
        "target": {"model": "vendor/model", "tokenizer": "unused"},
        "inference": {"kind": "endpoints", "endpoints": endpoints},
        "generation": generation,
        "datasets": [{"id": "B1", "source": "p.jsonl"}],
    }


def materialize_prompts(config: PipelineConfig, n: int) -> list[PromptRecord]:
    prompts = make_prompts(n)
    write_parquet(prompt_rows(prompts), PROMPT_SCHEMA, ArtifactLayout(config.artifacts_root).prompts("B1"))
    return prompts


def by_backend(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    [dataset] = document["datasets"]
    return {row["backend"]: row for row in dataset["backends"]}


@pytest.mark.slow
def test_plan_ranks_the_backends_from_calibration_and_evidence(tmp_path: Path, servers: Any) -> None:
    slow, fast = servers
    unpriced = FakeOpenAI(token_delay_s=0.001).start()
    try:
        path = write_pipeline(tmp_path, two_backends(tmp_path, slow, fast, unpriced.base_url))
        config = load_config(path)
        prompts = materialize_prompts(config, 40)

        blind = json.loads(plan_cli(path, "--json", secret=SECRET))
        assert {row["tokens_per_s"] for row in by_backend(blind).values()} == {"unknown"}, (
            "no evidence: unknown, not a guess"
        )
        assert (
            blind["datasets"][0]["best"] is None
            and "no backend has a measured throughput" in blind["datasets"][0]["why"]
        )
        assert len(slow.requests) == len(fast.requests) == 0, "without --calibrate nothing is sent"

        calibrated = json.loads(plan_cli(path, "--json", "--calibrate", "4", secret=SECRET))
        rows = by_backend(calibrated)
        assert len(slow.requests) == len(fast.requests) == 4
        assert rows["fast-api"]["tokens_per_s"] > 3 * rows["slow-box"]["tokens_per_s"] > 0
        assert rows["fast-api"]["throughput_source"].startswith("calibration: 4 answers")
        # 40 pending prompts, no answer yet: max_tokens (8) each is the bound; 5 prompt tokens each.
        assert rows["slow-box"]["completion_tokens_left"] == 320
        assert rows["fast-api"]["cost_usd"] == pytest.approx((200 * 1.0 + 320 * 2.0) / 1e6)
        assert rows["slow-box"]["cost_usd"] == pytest.approx((200 * 0.1 + 320 * 0.2) / 1e6)
        assert rows["no-price"]["cost_usd"] == "unknown" and rows["no-price"]["price_per_mtok"] == "unknown"
        assert rows["fast-api"]["eta_s"] < rows["slow-box"]["eta_s"]
        assert calibrated["datasets"][0]["best"] in {"fast-api", "no-price"}, "the fast ones finish first"

        ceiling = json.loads(plan_cli(path, "--json", "--calibrate", "4", "--max-cost", "0.0005", secret=SECRET))
        assert ceiling["datasets"][0]["best"] == "slow-box", (
            "the fast backends cost more than $0.0005 (or cannot be shown not to)"
        )

        text = plan_cli(path, "--calibrate", "4", "--max-cost", "0.001", secret=SECRET)
        (tmp_path / "plan.txt").write_text(text)
        [best_line] = [line for line in text.splitlines() if line.endswith("<- best")]
        assert best_line.startswith("B1") and "fast-api" in best_line and "calibration: 4 answers" in best_line
        assert "unknown" in next(line for line in text.splitlines() if "no-price" in line and line.startswith("B1"))

        # After a run, the checkpoint is the evidence: no calibration needed.
        run_dataset(config, prompts[:20], lambda: endpoints_from_config(config)[1:2])
        evidence = by_backend(json.loads(plan_cli(path, "--json", secret=SECRET)))
        assert evidence["fast-api"]["throughput_source"].startswith("checkpoint: 20 answers")
        assert evidence["slow-box"]["tokens_per_s"] == "unknown"
        assert evidence["fast-api"]["completion_tokens_left"] == 20 * 5, "20 pending × 5 tokens per answer so far"
    finally:
        unpriced.stop()


def run_dataset(
    config: PipelineConfig, prompts: list[PromptRecord], endpoints: Callable[[], Sequence[Endpoint]]
) -> DatasetResult:
    """`generate_dataset` of B1, given the slices of `config` it reads."""
    layout = ArtifactLayout(config.artifacts_root)
    dataset = config.dataset("B1")
    return generate_dataset(
        dataset,
        config.generation,
        target=config.target,
        inference=config.inference,
        layout=layout,
        prompts=prompts,
        resolve_endpoints=endpoints,
    )


def failover_run(
    tmp_path: Path, slow: FakeOpenAI, fast: FakeOpenAI, failover: dict[str, Any], n: int = 60, **generation: Any
) -> tuple[PipelineConfig, Any]:
    config = load_pipeline(
        tmp_path,
        two_backends(tmp_path, slow, fast),
        {"generation": {"failover": failover, **generation}},
        runtime_checks=True,
    )
    prompts = materialize_prompts(config, n)
    result = run_dataset(config, prompts, lambda: endpoints_from_config(config))
    return config, result


def assert_every_id_once(tmp_path: Path, n: int) -> list[dict[str, Any]]:
    stored = lines(tmp_path / "out" / "responses" / "B1.checkpoint.jsonl")
    ids = [r["id"] for r in stored]
    assert len(ids) == len(set(ids)) == n, "0 duplicated in the checkpoint"
    table = pq.read_table(tmp_path / "out" / "responses" / "B1.parquet").column("id").to_pylist()
    assert sorted(table) == sorted(p.id for p in make_prompts(n)), "0 lost, 0 duplicated in the table"
    return stored


def test_failover_by_deadline_moves_to_the_fast_backend_with_the_numbers(tmp_path: Path, servers: Any) -> None:
    slow, fast = servers
    _, result = failover_run(
        tmp_path, slow, fast, {"backends": ["slow-box", "fast-api"], "deadline_s": 1.5, "check_every_s": 0.3}
    )

    [decision] = lines(tmp_path / "out" / "responses" / "B1.failover.jsonl")
    (tmp_path / "decision.json").write_text(json.dumps(decision, indent=1))
    assert (decision["from"], decision["to"]) == ("slow-box", "fast-api") and decision["reason"].startswith("deadline")
    assert decision["tokens_per_s"] > 0 and decision["completion_tokens_left"] > 0
    assert decision["eta_s"] > decision["seconds_to_deadline"], "the ETA on the slow backend passed the deadline"
    assert decision["cost_left_on_new_usd"] > decision["cost_left_on_old_usd"] > 0
    assert result.summary.failovers == [decision] and result.summary.failed == 0

    stored = assert_every_id_once(tmp_path, 60)
    from_slow = Counter(r["endpoint"] for r in stored)[slow.base_url]
    sent = decision["requests_sent_to_old_backend"]
    assert from_slow == sent - decision["in_flight_moved"], (
        "every request sent to the slow backend was answered there or moved"
    )
    assert len(slow.requests) <= sent, "the slow server received nothing after the switch"
    assert Counter(r["endpoint"] for r in stored)[fast.base_url] == 60 - from_slow
    assert {r["model"] for r in stored} == {"vendor/model"}
    metadata = json.dumps(result.as_metadata(), default=str)
    assert SECRET not in metadata + json.dumps(decision)


def test_no_failover_when_the_deadline_is_within_reach(tmp_path: Path, servers: Any) -> None:
    slow, fast = servers
    failover_run(
        tmp_path, slow, fast, {"backends": ["fast-api", "slow-box"], "deadline_s": 3600, "check_every_s": 0.1}, n=30
    )
    assert not (tmp_path / "out" / "responses" / "B1.failover.jsonl").exists()
    assert len(slow.requests) == 0 and len(fast.requests) == 30


def test_failover_when_the_primary_dies_mid_run(tmp_path: Path, servers: Any) -> None:
    slow, fast = servers
    fast.token_delay_s = 0.0

    def dies_after_ten(body: dict[str, Any], n: int) -> Reply:
        return Reply() if n <= 10 else Reply(reset=True)

    slow.token_delay_s = 0.0
    slow.script = dies_after_ten
    _, result = failover_run(
        tmp_path, slow, fast, {"backends": [0, 1], "unhealthy_after_errors": 3, "check_every_s": 0.1}, n=40
    )

    [decision] = lines(tmp_path / "out" / "responses" / "B1.failover.jsonl")
    assert (decision["from"], decision["to"]) == ("slow-box", "fast-api") and decision["reason"].startswith(
        "unhealthy: 3 failed attempts"
    )
    assert decision["deadline"] is None
    stored = assert_every_id_once(tmp_path, 40)
    assert Counter(r["endpoint"] for r in stored) == {slow.base_url: 10, fast.base_url: 30}
    assert result.summary.failed == 0


def test_failover_when_the_primary_hangs_mid_run(tmp_path: Path, servers: Any) -> None:
    """A backend that stops answering without an error: the probes time out, the dataset moves, and
    the two requests hanging on the old backend are cancelled and sent again, once, to the new one."""
    slow, fast = servers
    slow.token_delay_s = 0.0
    slow.script = lambda body, n: Reply() if n <= 10 else Reply(hang=True)
    failover = {
        "backends": ["slow-box", "fast-api"],
        "check_every_s": 0.2,
        "probe_timeout_s": 0.5,
        "unhealthy_after_errors": 2,
    }
    _, result = failover_run(tmp_path, slow, fast, failover, n=40, read_timeout_s=120)

    [decision] = lines(tmp_path / "out" / "responses" / "B1.failover.jsonl")
    assert decision["reason"].startswith("unhealthy: 2 failed attempts") and "probe" in decision["reason"]
    assert (decision["requests_sent_to_old_backend"], decision["in_flight_moved"]) == (12, 2)
    stored = assert_every_id_once(tmp_path, 40)
    assert Counter(r["endpoint"] for r in stored) == {slow.base_url: 10, fast.base_url: 30}
    assert result.summary.failed == 0 and result.summary.moved_in_flight == 2


def test_failover_refuses_backends_of_different_models(tmp_path: Path, servers: Any) -> None:
    slow, fast = servers
    path = write_pipeline(
        tmp_path,
        two_backends(tmp_path, slow, fast),
        {"generation": {"failover": {"backends": ["slow-box", "fast-api"]}}},
    )
    document = json.loads(path.read_text())
    document["inference"]["endpoints"][1]["model"] = "other/model"
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="failover.backends serve different models"):
        load_config(path)
    document["inference"]["endpoints"][1]["model"] = None
    document["generation"]["failover"]["backends"] = ["slow-box", "nowhere"]
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="'nowhere' names no entry of inference.endpoints"):
        load_config(path)
    document["generation"]["failover"] = {"backends": [1, 0], "deadline": "2030-01-02T03:04:05+00:00"}
    path.write_text(json.dumps(document))
    loaded = load_config(path)
    settings = FailoverSettings.from_config(loaded.generation, loaded.inference, "B1", tmp_path / "f.jsonl")
    assert settings is not None and settings.names == ["fast-api", "slow-box"]
    assert settings.deadline_at == datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()
    document["generation"]["failover"]["deadline_s"] = 60
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="not both"):
        load_config(path)


def test_responses_materialization_carries_the_plan_and_the_decision(tmp_path: Path, servers: Any) -> None:
    slow, fast = servers
    failover = {"backends": ["slow-box", "fast-api"], "deadline_s": 1.5, "check_every_s": 0.3}
    path = write_pipeline(tmp_path, two_backends(tmp_path, slow, fast), {"generation": {"failover": failover}})
    (tmp_path / "p.jsonl").write_text(
        "".join(json.dumps({"conversations": [{"from": "human", "value": f"q {i}"}]}) + "\n" for i in range(40))
    )
    config = load_config(path)
    instance = dg.DagsterInstance.ephemeral()
    result = materialize_generation(config, instance)
    assert result.success
    [materialization] = result.asset_materializations_for_node("responses")
    metadata = {key: value.value for key, value in materialization.metadata.items()}
    [decision] = metadata["failover_decisions"]
    assert decision == lines(tmp_path / "out" / "responses" / "B1.failover.jsonl")[0]
    plan = metadata["plan"]
    assert "| B1 | slow-box |" in plan and "| B1 | fast-api |" in plan and "checkpoint:" in plan
    assert (
        len(ResponseCheckpoint(tmp_path / "out" / "responses" / "B1.checkpoint.jsonl").load()) == metadata["rows"] == 40
    )
    logs = "\n".join(dg.serialize_value(entry) for entry in instance.all_logs(result.run_id))
    assert SECRET not in logs and SECRET not in repr(metadata)


def test_tokens_left_are_capped_by_the_budget_in_completion_tokens() -> None:
    common = {
        "pending": 100,
        "answers": 10,
        "completion_done": 50,
        "prompt_done": 150,
        "bound_per_prompt": 8.0,
        "prompt_per_prompt": 5.0,
    }
    free = estimate_left("B1", budget_left=None, counts="completion", **common)
    assert (free.completion_left, free.prompt_left) == (500, 1500) and "100 pending × 5.0" in free.basis
    capped = estimate_left("B1", budget_left=20, counts="completion", **common)
    assert (capped.completion_left, capped.prompt_left) == (20, 60) and capped.basis.startswith("token budget: 20")
    both = estimate_left("B1", budget_left=40, counts="prompt_and_completion", **common)
    assert both.completion_left == 10, "a quarter of the counted tokens are completion tokens"
    fresh = estimate_left(
        "B1", budget_left=None, counts="completion", **{**common, "answers": 0, "completion_done": 0, "prompt_done": 0}
    )
    assert fresh.completion_left == 800 and "upper bound" in fresh.basis
    assert cost_of(None, 10, 10) is None and cost_of(Price(1.0, 2.0), 1_000_000, 500_000) == 2.0
