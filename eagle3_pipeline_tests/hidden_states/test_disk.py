"""The hidden states' disk per backend and storage dtype (`eagle3-pipeline plan`'s disk section):
the pinned Kimi-K2.5 figures, where the token count comes from, and the CLI's text and JSON.
Real files (a Kimi-sized config.json with no weights, a training_data manifest); no model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.cli import main
from eagle3_pipeline.hidden_states.disk import (
    config_disk_plan,
    disk_plan,
    specforge_bytes_per_token,
    training_tokens,
    vllm_file_bytes_per_token,
)
from eagle3_pipeline_tests.pipeline_files import load_pipeline, write_pipeline

KIMI_HIDDEN = 7168
KIMI_TOKENS = 88_000 * 1_250  # 88K prompts × 1.25K tokens each


def test_kimi_88k_prompts_per_backend_and_dtype() -> None:
    plan = disk_plan(
        KIMI_HIDDEN,
        3,
        tokens=KIMI_TOKENS,
        tokens_basis="88K × 1.25K",
        batch_tokens=8192,
        configured=("sglang", "float8_e4m3"),
    )
    rows = {(r.backend, r.dtype): (r.store_bytes, r.transient_bytes, r.peak_bytes) for r in plan.rows}
    bf16, fp8 = 110_000_000 * 57_349, 110_000_000 * 28_693
    specforge = 110_000_000 * (4 * 7168 * 2 + 16)
    vllm_batch = 8192 * (4 * 7168 * 2 + 8)
    assert (bf16, fp8, specforge, vllm_batch) == (6_308_390_000_000, 3_156_230_000_000, 6_309_600_000_000, 469_827_584)
    assert rows == {
        ("transformers", "bfloat16"): (bf16, 0, bf16),
        ("transformers", "float8_e4m3"): (fp8, 0, fp8),
        ("sglang", "bfloat16"): (bf16, 0, bf16),
        ("sglang", "float8_e4m3"): (fp8, 0, fp8),
        ("vllm", "bfloat16"): (bf16, vllm_batch, bf16 + vllm_batch),
        ("vllm", "float8_e4m3"): (fp8, vllm_batch, fp8 + vllm_batch),
        ("command", "bfloat16"): (bf16, specforge, bf16 + specforge),
        ("command", "float8_e4m3"): (fp8, specforge, fp8 + specforge),
    }
    assert vllm_file_bytes_per_token(KIMI_HIDDEN) == 57_352 and specforge_bytes_per_token(KIMI_HIDDEN) == 57_360
    text = plan.text()
    assert "110,000,000 training tokens" in text and "bfloat16 57,349 B, float8_e4m3 28,693 B per token" in text
    assert "sglang        float8_e4m3    3,156.2   0.0           3,156.2   unknown  <- configured" in text
    assert "vllm          float8_e4m3    3,156.2   0.5           3,156.7   unknown" in text
    assert "command       float8_e4m3    3,156.2   6,309.6       9,465.8   unknown" in text
    data = plan.as_dict()
    assert data["free_bytes"] == "unknown" and sum(r["configured"] for r in data["rows"]) == 1
    small = disk_plan(
        KIMI_HIDDEN,
        3,
        tokens=KIMI_TOKENS,
        tokens_basis="x",
        batch_tokens=8192,
        configured=("vllm", "bfloat16"),
        free_bytes=5 * 10**12,
        free_where="here",
    )
    assert {(r.backend, r.dtype) for r in small.rows if small.fits(r)} == {
        ("transformers", "float8_e4m3"),
        ("sglang", "float8_e4m3"),
        ("vllm", "float8_e4m3"),
    }


def kimi_target(tmp_path: Path, training_tokens: int | None) -> dict[str, Any]:
    """Pipeline sections whose target's config.json is Kimi's shape (as a folder under ``tmp_path``), and a
    training_data manifest of ``training_tokens`` where given."""
    target = tmp_path / "kimi"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"text_config": {
        "num_hidden_layers": 61, "hidden_size": KIMI_HIDDEN, "vocab_size": 163840, "num_attention_heads": 64,
        "intermediate_size": 18432}}))  # fmt: skip
    if training_tokens is not None:
        (tmp_path / "out" / "training_data").mkdir(parents=True)
        (tmp_path / "out" / "training_data" / "manifest.json").write_text(json.dumps({"tokens": training_tokens}))
    return {"name": "t", "target": {"model": "kimi", "tokenizer": str(target)}}


def test_tokens_come_from_training_data_else_the_planners_estimate(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path / "with", kimi_target(tmp_path / "with", KIMI_TOKENS), runtime_checks=True)
    assert training_tokens(config.artifacts_root / "training_data", {}, {"B1": (None, None)}) == (
        KIMI_TOKENS,
        str(config.artifacts_root / "training_data" / "manifest.json"),
    )
    config = load_pipeline(tmp_path / "without", kimi_target(tmp_path / "without", None), runtime_checks=True)
    records = {"B1": {"p1": {"prompt_tokens": 100, "completion_tokens": 400}}}
    tokens, basis = training_tokens(config.artifacts_root / "training_data", records, {"B1": (1_000, 3_000)})  # type: ignore[misc]
    assert tokens == 4_500 and basis.startswith("estimate")
    assert (
        training_tokens(config.artifacts_root / "training_data", records, {"B1": (None, 3_000)})
        == "unknown: the tokens left of B1 are unknown (prompts not materialized)"
    )


def test_config_disk_plan_reads_the_targets_config_and_the_compute_kind(tmp_path: Path) -> None:
    local = config_disk_plan(
        load_pipeline(
            tmp_path / "local",
            kimi_target(tmp_path / "local", KIMI_TOKENS),
            {"hidden_states": {"storage_dtype": "float8_e4m3"}},
            runtime_checks=True,
        ),
        {},
        {},
    )
    assert not isinstance(local, str)
    assert (
        local.hidden_size == KIMI_HIDDEN
        and local.tokens == KIMI_TOKENS
        and local.configured == ("transformers", "float8_e4m3")
    )
    assert local.free_bytes is not None and "on this machine" in local.free_where
    extra = {
        "compute": {
            "kind": "command",
            "command": "echo {output_dir}",
            "host": {"hostname": "gpu", "username": "u"},
            "workdir": "/w",
            "artifacts_root": "/a",
        },
        "hidden_states": {"model": "/models/Kimi-K2.5"},
    }
    remote_folder = tmp_path / "remote"
    remote = config_disk_plan(
        load_pipeline(remote_folder, kimi_target(remote_folder, KIMI_TOKENS), extra, runtime_checks=True), {}, {}
    )
    assert not isinstance(remote, str)
    assert (
        remote.configured == ("command", "bfloat16") and remote.free_bytes is None and "GPU host" in remote.free_where
    )
    missing = tmp_path / "missing"
    inference = {"kind": "endpoints", "endpoints": [{"name": "a", "base_url": "http://127.0.0.1:1/v1"}]}
    target = {"name": "t", "target": {"model": "kimi", "tokenizer": str(missing / "nowhere")}, "inference": inference}
    unknown = config_disk_plan(load_pipeline(missing, target, runtime_checks=True), {}, {})
    assert isinstance(unknown, str) and unknown.startswith(
        "hidden-state disk: unknown: no target config.json on this machine"
    )


def test_plan_prints_the_disk_section_in_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_pipeline(tmp_path, kimi_target(tmp_path, KIMI_TOKENS))
    assert main(["plan", "--config", str(path), "--json"]) == 0
    disk = json.loads(capsys.readouterr().out)["hidden_state_disk"]
    assert disk["tokens"] == KIMI_TOKENS and disk["bytes_per_token"] == {"bfloat16": 57_349, "float8_e4m3": 28_693}
    assert {(r["backend"], r["storage_dtype"]): r["store_bytes"] for r in disk["rows"]}[
        ("sglang", "float8_e4m3")
    ] == 3_156_230_000_000
    assert main(["plan", "--config", str(path)]) == 0
    assert "hidden-state disk for 110,000,000 training tokens" in capsys.readouterr().out
