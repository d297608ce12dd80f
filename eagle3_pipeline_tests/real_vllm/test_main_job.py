"""The main job on the embedded model through real vLLM servers (the CPU build): `eagle3-pipeline run` as a
real process on a temporary Dagster instance, once for the whole module, with `drafter_benchmark` in the
same pipeline file.

The test starts two servers of the embedded model (SmolLM2-135M-Instruct) and the pipeline two more:
- generation (`inference.kind: endpoints`): `--enable-auto-tool-choice --tool-call-parser hermes`, so the
  tools dataset's requests (tools, tool_choice auto) are served. SmolLM2's chat template has no tool
  markup; vLLM 0.32's hermes parser needs no special token (it looks for `<tool_call>` in the text) and
  leaves a plain answer as content. The same server answers training_data's `/tokenize` agreement check
  and the serving reference (`prompt_logprobs`) that hidden_states validates against;
- extraction (`hidden_states.backend: vllm`): `extract_hidden_states` with the layer ids the store needs,
  computed with the project's own functions (output-of-layer ids → vLLM's, plus the last layer);
- `drafter_benchmark` (`server: vllm`): the pipeline starts the target without and with the exported
  drafter through `launch_command` (the venv's python, `-m vllm.entrypoints.openai.api_server`: the `vllm`
  command is broken in this build), with the environment as `sh -c` assignments, and stops each.

Sized for CI: 8 prompts per shipped dataset, 64 tokens each, a few training epochs. The drafter is weak
(τ ≈ 1.1 on these few rows); what is checked is that the server's τ agrees with drafter_eval's offline τ
on the same eval prompts (see :func:`test_drafter_benchmark_tau_matches_drafter_eval` for the bound).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_pipeline.hidden_states.store import default_aux_layer_ids
from eagle3_pipeline.layer_ids import extraction_layer_ids, target_family
from eagle3_pipeline.managed.launch import extraction_args
from eagle3_pipeline.target import read_config
from eagle3_pipeline.testing.real_vllm import (
    benchmark_launch_command,
    free_port,
    process_pattern,
    vllm_server,
)

# The module's one pipeline run (four vLLM servers, generation, training, the benchmark) is in the first
# test's setup: ~8 minutes on two quiet cores, more on a busy machine.
pytestmark = [pytest.mark.e2e, pytest.mark.local_model, pytest.mark.timeout(1800)]
CLI_TIMEOUT_S = 1500

SAMPLES = Path(__file__).resolve().parents[2] / "eagle3_pipeline" / "samples"
DATASETS = {"B1_chat": "chat.jsonl", "B2_tools": "tools.jsonl", "B3_code": "code.jsonl", "B4_math": "math.jsonl"}
PER_DATASET = 8
MAX_TOKENS = 64
STEPS = 3
SERVED = "smol"


@dataclass(frozen=True)
class PipelineRun:
    result: subprocess.CompletedProcess[str]
    out: Path
    server_logs: list[Path]
    server_layers: list[int]
    benchmark_port: int
    metadata: dict[str, dict[str, Any]]  # asset → its latest materialization's metadata


def store_server_layers(model: Path) -> list[int]:
    """vLLM's ``eagle_aux_hidden_state_layer_ids`` for the store's default aux layers, then the last layer."""
    config = read_config(str(model))
    layers = int(config["num_hidden_layers"])
    return extraction_layer_ids(target_family(config), default_aux_layer_ids(layers), layers)


def pipeline_file(
    root: Path, model: Path, python: Path, generation: Any, extraction: Any, states: Path, port: int
) -> Path:
    document = {
        "name": "vllm_e2e",
        "artifacts_root": "out",
        "seed": 1234,
        "target": {"model": SERVED, "tokenizer": str(model), "max_seq_len": 2048},
        "inference": {"kind": "endpoints", "endpoints": [{"base_url": generation.base_url}]},
        "generation": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "concurrency": 8},
        "health": {
            "host": {"kind": "local"},
            "server": {"kind": "vllm", "port": generation.port, "process_pattern": process_pattern(generation.port)},
            "expected_gpus": 0,
            "min_disk_free_gb": 1,
            "min_mem_free_gb": 1,
            "max_truncation_rate": 1.0,
        },
        # Two held-out rows per dataset: every dataset has a τ row; ~23 rows left to train on.
        "training_data": {"eval_fraction": 0.05, "held_out_per_dataset": 2},
        "draft_vocab": {"size": 2048, "min_coverage": 0.5},
        "hidden_states": {
            "backend": "vllm",
            "model": str(model),
            "vllm_base_url": extraction.base_url,
            "vllm_output_dir": str(states),
            "shard_tokens": 4096,
            "validation": {"samples": 4},
        },
        "drafter": {"ttt_steps": STEPS, "lr": 0.003, "epochs": 6, "batch_tokens": 2048, "max_seq_len": 512},
        "drafter_eval": {"steps": [STEPS]},
        "drafter_benchmark": {
            "server": "vllm",
            "target_model_path": str(model),
            "draft_model_path": str(root / "out" / "drafter" / "export"),
            "port": port,
            "base_url": f"http://127.0.0.1:{port}",
            "steps": STEPS,
            "launch_command": benchmark_launch_command(python),
            # The generation and extraction servers (and other work's) are vLLM servers too.
            "process_pattern": process_pattern(port),
            "log_dir": str(root / "out" / "benchmark"),
            "prompts": 1000,  # every eval row: the prompts drafter_eval measures
            "max_tokens": MAX_TOKENS,  # the stored responses' budget
            "concurrency": 1,
            "startup_timeout_s": 600,
        },
        "datasets": [
            {"id": name, "source": str(SAMPLES / source), "sample_size": PER_DATASET}
            for name, source in DATASETS.items()
        ],
    }
    path = root / "pipeline.yaml"
    path.write_text(json.dumps(document, indent=2))
    return path


def run_cli(config: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """`eagle3-pipeline run`; past the timeout it is interrupted (SIGINT) so that the step in flight stops
    what it started (drafter_benchmark's servers run in sessions of their own), then killed."""
    command = [sys.executable, "-m", "eagle3_pipeline.cli", "run", "--config", str(config)]
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=config.parent
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=CLI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)
            try:
                stdout, stderr = process.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, stderr = process.communicate()
            pytest.fail(f"eagle3-pipeline run took over {CLI_TIMEOUT_S} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def until_shutdown(log: str) -> str:
    """A server log up to its first ``[shutdown]`` line: stopped with SIGTERM, vLLM 0.32 may log an
    ``EngineDeadError`` traceback from its output handler as it tears the engine down (a race in
    ``AsyncLLM.shutdown``, vllm-project/vllm#48745), which says nothing about how it served."""
    lines = log.splitlines()
    end = next((i for i, line in enumerate(lines) if "[shutdown]" in line), len(lines))
    return "\n".join(lines[:end])


def latest_metadata(home: Path, assets: list[str]) -> dict[str, dict[str, Any]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DAGSTER_HOME", str(home))
        with dg.DagsterInstance.from_config(str(home)) as instance:
            found = {}
            for asset in assets:
                event = instance.get_latest_materialization_event(dg.AssetKey(asset))
                if event is not None and event.asset_materialization is not None:
                    found[asset] = {k: v.value for k, v in event.asset_materialization.metadata.items()}
            return found


@pytest.fixture(scope="module")
def run(real_vllm_python: Path, local_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PipelineRun]:
    root = tmp_path_factory.mktemp("vllm_main_job")
    states = root / "states"
    states.mkdir()
    layers = store_server_layers(local_model)
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with (
        vllm_server(local_model, root / "generation.log", served_name=SERVED, extra_args=tools) as generation,
        vllm_server(
            local_model, root / "extraction.log", served_name=SERVED, extra_args=extraction_args(layers, states)
        ) as extraction,
    ):
        port = free_port()
        config = pipeline_file(root, local_model, real_vllm_python, generation, extraction, states, port)
        home = root / "home"
        result = run_cli(config, home)
    assets = ["training_data", "hidden_states", "drafter_eval", "drafter_benchmark"]
    logs = [root / "generation.log", root / "extraction.log", *sorted((root / "out" / "benchmark").glob("*.log"))]
    yield PipelineRun(result, root / "out", logs, layers, port, latest_metadata(home, assets))


def test_main_job_through_real_vllm(run: PipelineRun) -> None:
    result = run.result
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:3] for line in result.stdout.splitlines() if line.startswith("B")}
    assert rows == {name: [str(PER_DATASET), str(PER_DATASET)] for name in DATASETS}, result.stdout
    training = run.metadata["training_data"]
    assert training["rows"] == PER_DATASET * len(DATASETS)
    assert training["tokenizer_agreement"] == "ok", training["tokenizer_agreement_detail"]
    assert "/tokenize" in training["tokenizer_agreement_detail"]
    assert "(vllm)" in training["serving_reference_status"]

    states = run.metadata["hidden_states"]
    assert states["backend"] == "vllm" and states["capture"]["eagle_aux_hidden_state_layer_ids"] == run.server_layers
    assert states["serving_validation"] == "passed" and states["serving_agreement"] >= 0.9
    assert states["samples"] == PER_DATASET * len(DATASETS)
    assert states["bytes_per_token_formula"] == 4613 and abs(states["bytes_per_token"] - 4613) < 1
    assert f"bytes/token (formula {states['bytes_per_token_formula']})" in result.stdout

    assert "acceptance length τ on the eval split" in result.stdout
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert {line.split("|")[1].strip() for line in table} >= {*DATASETS, "all"}
    evaluation = run.metadata["drafter_eval"]
    assert all(1.0 <= evaluation[f"tau@{STEPS}/{name}"] <= STEPS + 1 for name in DATASETS)
    # greedy answers of the same server: the stored tokens are (nearly all) its argmax
    assert evaluation["data_agreement/all"] >= 0.9

    for log in run.server_logs:
        served = until_shutdown(log.read_text(errors="replace"))
        assert "Traceback" not in served, f"{log.name}:\n{served[-3000:]}"
    assert [log.name for log in run.server_logs[2:]] == ["baseline.log", "speculative.log"]
    print(result.stdout[result.stdout.index("dataset") :])
    print(
        f"validation: {states['serving_validation_detail']} (agreement {states['serving_agreement']}, "
        f"{states['serving_near_ties']} near-ties apart); tokenizer: {training['tokenizer_agreement_detail']}"
    )


def test_drafter_benchmark_tau_matches_drafter_eval(run: PipelineRun) -> None:
    """τ from vLLM's own counters against drafter_eval's offline τ on the same eval prompts.

    Both are greedy chain drafting at K = 3 over the eval rows' responses; they differ by numerics (the
    served drafter runs in bf16 on the states of vLLM's verify pass, drafter_eval in float32 on the stored
    bf16 states of the extraction pass), by the server's own greedy continuation wherever bf16 breaks a
    near-tie the other way than the stored answer, and by counting (vLLM counts the last step's drafts
    accepted past the end of a response; drafter_eval stops at the end). The first two are random per
    draft, so the bound is statistical: τ - 1 is the mean number of accepted drafts per verify step,
    whose standard error over the server's N steps is sqrt(var / N), var from the per-position counters;
    two independent estimates of the same mean differ by less than 3·sqrt(2) standard errors (the two
    share their prompts and drafter, so they differ less). The counting concerns the last step of a
    request, whose K drafts vLLM schedules in full even where fewer tokens are left: it adds about
    requests · K · P(accept) / N. At this size (τ - 1 ≈ 0.1 over ~10 prompts) the bound catches a drafter
    the server does not run as trained (accepting next to nothing), not a difference of a few percent.
    """
    assert run.result.returncode == 0, run.result.stderr[-3000:]
    bench = run.metadata["drafter_benchmark"]
    evaluation = run.metadata["drafter_eval"]
    baseline, speculative = bench["arms"]
    assert bench["requests"] == evaluation["eval_samples/all"], "the benchmark sends every eval row's prompt"
    for arm in (baseline, speculative):
        assert re.match(
            r"vllm server pid \d+: \S*python\S* -m vllm\.entrypoints\.openai\.api_server ", arm["server_process"]
        ), arm["server_process"]
        assert f"--port {run.benchmark_port}" in arm["server_process"], arm["server_process"]
    assert "--speculative-config" in speculative["server_process"]

    steps = speculative["verify_steps"]
    rates = [bench[f"acceptance_pos{p}"] for p in range(STEPS)]
    mean = sum(rates)  # E[accepted drafts per step] = Σ_p P(accepted >= p + 1)
    assert bench["tau_server"] == pytest.approx(1 + mean, abs=1e-3)
    second_moment = sum((2 * p + 1) * rate for p, rate in enumerate(rates))  # E[a²] = Σ_p (2p+1)·P(a > p)
    error = math.sqrt(max(second_moment - mean**2, 0.0) / steps)
    bound = 3 * math.sqrt(2) * error + bench["requests"] * STEPS * rates[0] / steps
    offline = evaluation[f"tau@{STEPS}/all"]
    print(
        f"τ@{STEPS} server {bench['tau_server']:.4f} vs drafter_eval {offline:.4f} (bound {bound:.4f}); "
        f"per depth server {[bench.get(f'accept_d{j}') for j in range(1, STEPS + 1)]} vs drafter_eval "
        f"{[evaluation.get(f'accept_d{j}/all') for j in range(1, STEPS + 1)]}; {steps} verify steps; "
        f"tokens/s speculative/baseline {bench['speedup']:.3f} ({speculative['tokens_per_s']:.1f} / "
        f"{baseline['tokens_per_s']:.1f}); completion tokens {baseline['completion_tokens']} / "
        f"{speculative['completion_tokens']}"
    )
    assert abs(bench["tau_server"] - offline) <= bound
    assert bench["speedup"] > 0
