"""The fit check in a real Dagster run: a pipeline file whose later phase cannot fit its machine is refused
at the first `responses` run, before any request, with the figures; `machine.check: per_phase` lets generation
run. The machine is declared (this machine has no GPU: the live read finds none and the declaration fills in)."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline_tests.dagster_runs import failure_description, materialize_generation
from eagle3_pipeline_tests.pipeline_files import load_pipeline

LLAMA_70B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
    "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}  # fmt: skip


def pipeline(folder: Path, server: FakeOpenAI, check: str) -> PipelineConfig:
    target = folder / "llama-70b"
    target.mkdir(exist_ok=True)
    (target / "config.json").write_text(json.dumps(LLAMA_70B))
    write_jsonl(folder / "p.jsonl", [sharegpt(f"question {i}") for i in range(4)])
    sections = {
        "name": "toobig",
        "target": {"model": "vendor/model", "tokenizer": "unused"},
        "inference": {"kind": "endpoints", "endpoints": [{"base_url": server.base_url}]},
        "generation": {"max_tokens": 8, "fsync": "never", "length_estimator": "chars", "progress_interval_s": 0.05},
        "hidden_states": {"model": str(target)},
        "machine": {"gpu": "RTX 4090", "gpus": 1, "check": check},
        "datasets": [{"id": "B1", "source": "p.jsonl", "token_budget": 1000}],
    }
    return load_pipeline(folder, sections, runtime_checks=True)


def test_a_target_too_big_for_the_gpus_is_refused_before_generation(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    result = materialize_generation(
        pipeline(tmp_path, fake_openai, "before_generation"), dg.DagsterInstance.ephemeral()
    )
    assert not result.success
    message = failure_description(result)
    assert message.startswith("generation is not started: a later phase cannot fit this machine")
    assert "hidden_states: gpu: 146.6 GiB needed per GPU of 22.8 GiB — does not fit" in message
    assert "(change hidden_states.backend sglang or vllm (tensor parallelism))" in message
    assert "RTX 4090" in message
    assert fake_openai.requests == [], "no request was sent"


def test_per_phase_lets_generation_run(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    result = materialize_generation(pipeline(tmp_path, fake_openai, "per_phase"), dg.DagsterInstance.ephemeral())
    assert result.success
    asked = [r["messages"][-1]["content"] for r in fake_openai.requests if r["max_tokens"] > 1]
    assert sorted(asked) == [f"question {i}" for i in range(4)]
