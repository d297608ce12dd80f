"""The embedded model (SmolLM2-135M-Instruct, the stand-in for the target) served by real vLLM (CPU build 0.32,
eager, bf16, 2048 context) with nothing else: no drafter, no tool-call parser, the default 1 GiB KV cache. A vLLM
start is what these tests cost, so the module starts that server once (:func:`target`) and each test reads its own
part of it; the fit's second KV setting (2 GiB) is the one other start.

**The capability probe**: the shipped tools samples through `responses` to that server: the partition fails
before any of its requests, and the error names the flags. The same samples served with
`--enable-auto-tool-choice --tool-call-parser hermes` generate in the main job (test_main_job.py, whose tools
partition records every probe as ok).

**Prompt sets**: a loop-prone prompt is flagged. Under greedy decoding the tiny target answers "Write a poem where
every line is 'the sky is blue'." with a short block ("A fleeting sight, a fleeting sight,") repeated to the end,
while a plain question ends normally (the flag reads the completion's token ids, which the target decides; τ per
category is then None, no verify step having run).

**The resource model** (``eagle3_pipeline.fit``) against what vLLM reports when it starts the model with
``VLLM_CPU_KVCACHE_SPACE`` = 1 (this module's server) and 2 GiB.

KV cache: the CPU worker logs ``Explicitly set (1.0/23.54) GiB for KV cache on node 0.`` and the engine
``CPU KV cache size: 46,592 tokens, Maximum concurrency for 2,048 tokens per request: 22.75x``. The fit predicts
``space × 2^30 / kv_per_token(config.json, tp=1, "auto")`` tokens; vLLM allocates whole blocks of
``block_size`` tokens (128 on the CPU backend for a non-MLA model), so the logged figure is the prediction rounded
down to a multiple of 128: checked to within one block (and ≤ the prediction), far inside 10 %.

Weights: the CPU build prints no ``Model loading took X GiB`` (only the GPU model runners do); the figure it logs
is ``Checkpoint size: 0.50 GiB`` (weight_utils, the files' bytes), which ``read_weights(folder).total_bytes`` (the
safetensors headers) must match within 5 %. What the server holds: this checkpoint is float32 and vLLM downcasts
it (``Downcasting torch.float32 to torch.bfloat16``), so 2 bytes per parameter — ``per_gpu_bytes(1)``, which
counts float32 modules as bfloat16, is half the files' bytes.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.drafter.serve.benchmark import measure_prompt_sets
from eagle3_pipeline.drafter.serve.prompt_sets import BenchPrompt
from eagle3_pipeline.drafter.serve.set_tau import SetSettings
from eagle3_pipeline.fit.checkpoint import read_weights
from eagle3_pipeline.fit.engines import kv_per_token
from eagle3_pipeline.generation import ResponseCheckpoint
from eagle3_pipeline.target.folder import load_tokenizer
from eagle3_pipeline.testing.real_vllm import DEFAULT_ENV, RunningVllm, vllm_server
from eagle3_pipeline_tests.dagster_runs import failure_description, materialize_generation
from eagle3_pipeline_tests.pipeline_files import load_pipeline

pytestmark = [pytest.mark.local_model, pytest.mark.timeout(900)]

SAMPLES = Path(__file__).resolve().parents[2] / "eagle3_pipeline" / "samples" / "tools.jsonl"
PROMPTS = 12
VLLM_REFUSAL = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
LOOP_PRONE = "Write a poem where every line is 'the sky is blue'."
PLAIN = "What is the capital of France? Answer in one sentence."
GIB = 1024**3
CPU_BLOCK_SIZE = 128  # vllm/platforms/cpu.py: the CPU backend's default block_size (non-MLA)
KV_LINE = re.compile(r"CPU KV cache size: ([\d,]+) tokens")
SPACE_LINE = re.compile(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache")
CHECKPOINT_LINE = re.compile(r"Checkpoint size: ([\d.]+) GiB")
DOWNCAST_LINE = re.compile(r"Downcasting torch\.(\w+) to torch\.(\w+)")


@dataclass(frozen=True)
class Started:
    space_gib: int
    log: str


@pytest.fixture(scope="module")
def target(
    real_vllm_python: Path, local_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningVllm]:
    """The module's one server of the target alone (the default 1 GiB KV cache)."""
    with vllm_server(local_model, tmp_path_factory.mktemp("vllm") / "server.log", served_name="smol") as server:
        yield server


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


def chat_requests(server: RunningVllm, since: int) -> list[str]:
    """The statuses of the chat completions the server's access log shows from byte ``since`` on."""
    text = server.log.read_bytes()[since:].decode(errors="replace")
    return re.findall(r'"POST /v1/chat/completions HTTP/1.1" (\d+)', text)


def test_tools_fail_before_any_request_without_a_tool_parser(
    target: RunningVllm, local_model: Path, tmp_path: Path
) -> None:
    since = target.log.stat().st_size
    with dg.DagsterInstance.ephemeral() as instance:
        failed = materialize_generation(pipeline(tmp_path, target, local_model), instance, "tools")
    statuses = chat_requests(target, since)
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


def test_a_loop_prone_prompt_is_flagged_and_a_plain_one_is_not(target: RunningVllm, local_model: Path) -> None:
    prompts = [
        BenchPrompt("probe", "chat", "plain", turns=(PLAIN,)),
        BenchPrompt("probe", "chat", "loop", turns=(LOOP_PRONE,)),
    ]
    settings = SetSettings(max_tokens=96, concurrency=2)
    tokenizer = load_tokenizer(str(local_model))
    figures = measure_prompt_sets(
        "vllm", target.root_url, prompts=prompts, tokenizer=tokenizer, settings=settings, timeout_s=300.0
    )
    (category,) = figures["categories"]
    assert category["requests"] == 2 and category["tau"] is None
    (flag,) = figures["loop_flagged"]
    print(f"loop-flagged: {flag}")
    assert (flag["id"], flag["turn"]) == ("loop", 1)
    assert flag["repeated"] >= 32 and flag["period"] <= 16
    tail = flag["tail"]
    assert tail[-16:] in tail[:-16]  # the text's end repeats too (here "A fleeting sight, a fleeting sight,")


@pytest.fixture(scope="module", params=[1, 2], ids=lambda gib: f"kv{gib}GiB")
def started(
    request: pytest.FixtureRequest, local_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Started]:
    """The start log of a server with ``VLLM_CPU_KVCACHE_SPACE`` = the param: the module's server where that is its
    setting (the default, 1 GiB), else one started here (2 GiB)."""
    space = int(request.param)
    if str(space) == DEFAULT_ENV["VLLM_CPU_KVCACHE_SPACE"]:
        target: RunningVllm = request.getfixturevalue("target")
        yield Started(space, target.log.read_text(errors="replace"))
        return
    request.getfixturevalue("real_vllm_python")
    log = tmp_path_factory.mktemp(f"fit_vllm_kv{space}") / "vllm.log"
    with vllm_server(local_model, log, served_name="smol", env={"VLLM_CPU_KVCACHE_SPACE": str(space)}):
        text = log.read_text(errors="replace")
    yield Started(space, text)


def one(pattern: re.Pattern[str], log: str) -> re.Match[str]:
    found = pattern.search(log)
    assert found, f"no line matching {pattern.pattern!r} in vLLM's log"
    return found


def test_kv_tokens_and_weights_match_the_fit(started: Started, local_model: Path) -> None:
    raw = json.loads((local_model / "config.json").read_text())
    per_token = kv_per_token(raw, 1, "auto")
    kv_line = one(KV_LINE, started.log)
    measured_tokens = int(kv_line.group(1).replace(",", ""))
    space_logged = float(one(SPACE_LINE, started.log).group(1))
    predicted_tokens = started.space_gib * GIB / per_token
    rounded = math.floor(predicted_tokens / CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE

    weights = read_weights(local_model)
    files = weights.total_bytes
    held = weights.per_gpu_bytes(1)
    checkpoint_gib = float(one(CHECKPOINT_LINE, started.log).group(1))
    downcast = one(DOWNCAST_LINE, started.log)

    kv_error = (predicted_tokens - measured_tokens) / measured_tokens
    weight_error = (files / GIB - checkpoint_gib) / checkpoint_gib
    print(
        f"\nVLLM_CPU_KVCACHE_SPACE={started.space_gib}: logged {kv_line.group(0)!r}, space {space_logged} GiB; "
        f"predicted {started.space_gib} × 2^30 / {per_token:,.0f} B/token = {predicted_tokens:,.1f} tokens "
        f"({kv_error:+.3%}), in whole {CPU_BLOCK_SIZE}-token blocks {rounded:,}"
        f"\nweights: the files {files / GIB:.4f} GiB ({weights.basis}) vs logged 'Checkpoint size: "
        f"{checkpoint_gib:.2f} GiB' ({weight_error:+.2%}); served after {downcast.group(0)!r}: {held / GIB:.4f} GiB"
    )
    assert space_logged == pytest.approx(started.space_gib)
    assert measured_tokens == rounded, "the prediction rounded down to whole blocks is exactly what vLLM allocates"
    assert 0 <= predicted_tokens - measured_tokens < CPU_BLOCK_SIZE
    assert abs(kv_error) < 0.10
    assert abs(weight_error) < 0.05
    assert (downcast.group(1), downcast.group(2)) == ("float32", "bfloat16")
    assert held == pytest.approx(files / 2, rel=1e-6)
