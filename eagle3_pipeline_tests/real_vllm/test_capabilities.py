"""The capability probe against real vLLM: the shipped tools samples through `responses` to the embedded
model served without a tool-call parser: the partition fails before any of its requests, and the error
names the flags. The same samples served with `--enable-auto-tool-choice --tool-call-parser hermes`
generate in the main job (test_main_job.py, whose tools partition records every probe as ok)."""

from __future__ import annotations

import re
from pathlib import Path

import dagster as dg
import pytest

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation import ResponseCheckpoint
from eagle3_pipeline.testing.real_vllm import RunningVllm, vllm_server
from eagle3_pipeline_tests.dagster_runs import failure_description, materialize_generation
from eagle3_pipeline_tests.pipeline_files import load_pipeline

pytestmark = pytest.mark.local_model

SAMPLES = Path(__file__).resolve().parents[2] / "eagle3_pipeline" / "samples" / "tools.jsonl"
PROMPTS = 12
VLLM_REFUSAL = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def pipeline(folder: Path, server: RunningVllm, model: Path) -> PipelineConfig:
    sections = {
        "name": "capabilities",
        "target": {"model": server.served_name, "tokenizer": str(model)},
        "inference": {"kind": "endpoints", "endpoints": [{"base_url": server.base_url}]},
        "generation": {"max_tokens": 8, "concurrency": 4},
        "health": {"max_truncation_rate": 1.0},
        "datasets": [{"id": "tools", "source": str(SAMPLES), "sample_size": PROMPTS}],
    }
    return load_pipeline(folder, sections, runtime_checks=True)


def chat_requests(server: RunningVllm) -> list[str]:
    """The statuses of the chat completions the server's access log shows."""
    return re.findall(r'"POST /v1/chat/completions HTTP/1.1" (\d+)', server.log.read_text(errors="replace"))


def test_tools_fail_before_any_request_without_a_tool_parser(
    real_vllm_python: Path, local_model: Path, tmp_path: Path
) -> None:
    with dg.DagsterInstance.ephemeral() as instance:
        with vllm_server(local_model, tmp_path / "bare.log", served_name="smol") as bare:
            failed = materialize_generation(pipeline(tmp_path, bare, local_model), instance, "tools")
            statuses = chat_requests(bare)
    assert not failed.success
    message = failure_description(failed)
    print(f"\nthe partition's error without a tool parser:\n{message}\nchat completions served: {statuses}")
    assert message.startswith("tools: the server lacks what this dataset needs, so no request of the partition")
    assert VLLM_REFUSAL in message
    assert "start vLLM with --enable-auto-tool-choice --tool-call-parser <name>" in message
    assert "SGLang with --tool-call-parser <name>" in message
    assert statuses.count("400") == 1, "the one probe with tools was refused, no request of the partition"
    assert len(statuses) <= 3, "the health gate's completion and the two probes, nothing else"
    assert not ResponseCheckpoint(tmp_path / "out" / "responses" / "tools.checkpoint.jsonl").load()
    assert not (tmp_path / "out" / "responses" / "tools.errors.jsonl").exists(), "no request failed"
