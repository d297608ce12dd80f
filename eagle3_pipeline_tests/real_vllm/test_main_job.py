"""The main job on the embedded model with a managed real vLLM (the CPU build), from no server to a served
drafter: `eagle3-pipeline run` as a real process on a temporary Dagster instance, once for the whole module,
then `eagle3-pipeline server status` and `server stop`.

The pipeline file describes the server once (`serving.managed`, engine vllm, the venv's python, the embedded
model SmolLM2-135M-Instruct, the CPU settings in `extra_args` and `env`); it fills in the inference endpoint,
the health checks' server and the extraction server's URL and folder. Nothing is started by the test. The
pipeline starts, in turn (each start and stop an event on the run and an observation of `inference_server`):
- the generation server, on demand for the first `responses` partition (kept for the others), with
  `--enable-auto-tool-choice --tool-call-parser hermes` (named in `serving.tool_call_parser`: SmolLM2's
  family has no known parser; vLLM 0.32's hermes parser needs no special token and leaves a plain answer as
  content), so the tools dataset's requests are served; it also answers training_data's `/tokenize`
  agreement check;
- the extraction server for `hidden_states` (backend vllm), in place of the generation server, with the
  layer ids the store needs, from the server's own config.json (the extractor proves them from its command
  line); it records the serving reference and is stopped after (no generation work remains);
- `eagle3_drafter` and `drafter_eval` find the GPUs free (nothing to hand over);
- `drafter_benchmark`'s two arms: the managed server's launch lines without and with the exported drafter;
- `served_drafter`: the server with the trained drafter (none was served), its τ from vLLM's counters, when the
  benchmark found it faster than the target alone at concurrency 1; else the target alone, with the reason.
`server stop` stops it, verified (no process of its group, the port closed).

Sized for CI: 8 prompts per shipped dataset, 64 tokens each, a few training epochs. The drafter is weak
(τ ≈ 1.1 on these few rows); what is checked is that the server's τ agrees with drafter_eval's offline τ
on the same eval prompts (see :func:`test_drafter_benchmark_tau_matches_drafter_eval` for the bound).
This module replaces the earlier main-job run with servers the test started by hand: one run covers both.
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
from eagle3_pipeline.target.folder import read_config
from eagle3_pipeline.target.layer_ids import extraction_layer_ids, target_family
from eagle3_pipeline.testing.process_groups import processes_of
from eagle3_pipeline.testing.real_vllm import free_port, managed_serving

# The module's one pipeline run (five vLLM servers in turn, generation, training, the benchmark, the served
# drafter) is in the first test's setup: ~9 minutes on two quiet cores, more on a busy machine.
pytestmark = [pytest.mark.e2e, pytest.mark.local_model, pytest.mark.timeout(1800)]
CLI_TIMEOUT_S = 1500

SAMPLES = Path(__file__).resolve().parents[2] / "eagle3_pipeline" / "samples"
DATASETS = {"B1_chat": "chat.jsonl", "B2_tools": "tools.jsonl", "B3_code": "code.jsonl", "B4_math": "math.jsonl"}
PER_DATASET = 8
MAX_TOKENS = 64
STEPS = 3
SERVED = "smol"
ROLES = ["generation", "extraction", "benchmark-baseline", "benchmark-speculative", "served-drafter"]


@dataclass(frozen=True)
class PipelineRun:
    result: subprocess.CompletedProcess[str]
    status: subprocess.CompletedProcess[str]
    stop: subprocess.CompletedProcess[str]
    out: Path
    server_log: Path
    server_layers: list[int]
    port: int
    metadata: dict[str, dict[str, Any]]  # asset → its latest materialization's metadata
    events: list[dict[str, Any]]  # the observations of inference_server, in order


def store_server_layers(model: Path) -> list[int]:
    """vLLM's ``eagle_aux_hidden_state_layer_ids`` for the store's default aux layers, then the last layer."""
    config = read_config(str(model))
    layers = int(config["num_hidden_layers"])
    return extraction_layer_ids(target_family(config), default_aux_layer_ids(layers), layers)


def pipeline_file(root: Path, model: Path, python: Path, port: int) -> Path:
    document = {
        "name": "vllm_e2e",
        "artifacts_root": "out",
        "seed": 1234,
        "target": {"model": SERVED, "tokenizer": str(model), "max_seq_len": 2048},
        "serving": managed_serving(
            python,
            model,
            port,
            root / "serving",
            served_name=SERVED,
            tool_call_parser="hermes",
            served_drafter_max_tokens=MAX_TOKENS,
        ),
        "generation": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "concurrency": 8},
        "health": {
            "host": {"kind": "local"},
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
            "shard_tokens": 4096,
            "validation": {"samples": 4},
        },
        "drafter": {"ttt_steps": STEPS, "lr": 0.003, "epochs": 6, "batch_tokens": 2048, "max_seq_len": 512},
        "drafter_eval": {"steps": [STEPS]},
        "drafter_benchmark": {
            "server": "vllm",
            "steps": STEPS,
            "prompts": 1000,  # every eval row: the prompts drafter_eval measures
            "max_tokens": MAX_TOKENS,  # the stored responses' budget
            "concurrencies": [1],
            "sweep_steps": [],  # one configuration, K = 3: the sweep is benchmarks/speculative_sweep.py's
            "max_server_starts": 2,
        },
        "datasets": [
            {"id": name, "source": str(SAMPLES / source), "sample_size": PER_DATASET}
            for name, source in DATASETS.items()
        ],
    }
    path = root / "pipeline.yaml"
    path.write_text(json.dumps(document, indent=2))
    return path


def cli(config: Path, home: Path, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """`eagle3-pipeline ARGS --config CONFIG`; past the timeout it is interrupted (SIGINT) so that the step in
    flight stops what it started, then killed."""
    command = [sys.executable, "-m", "eagle3_pipeline.cli", *args, "--config", str(config)]
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=config.parent
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)
            try:
                stdout, stderr = process.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, stderr = process.communicate()
            pytest.fail(f"eagle3-pipeline {args[0]} took over {timeout_s} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def until_shutdown(log: str) -> str:
    """Each start's part of the server log up to its ``[shutdown]`` line: stopped with SIGTERM, vLLM 0.32 may log
    an ``EngineDeadError`` traceback from its output handler as it tears the engine down (a race in
    ``AsyncLLM.shutdown``, vllm-project/vllm#48745), which says nothing about how it served."""
    kept = []
    for part in re.split(r"(?m)^=== .* eagle3-pipeline starts ", log):
        lines = part.splitlines()
        end = next((i for i, line in enumerate(lines) if "[shutdown]" in line), len(lines))
        kept.append("\n".join(lines[:end]))
    return "\n".join(kept)


def instance_records(home: Path, assets: list[str]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The latest materialization's metadata of each asset and of each responses partition (as
    ``responses/<dataset>``), and every observation of inference_server."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DAGSTER_HOME", str(home))
        with dg.DagsterInstance.from_config(str(home)) as instance:
            found = {}
            for asset in assets:
                event = instance.get_latest_materialization_event(dg.AssetKey(asset))
                if event is not None and event.asset_materialization is not None:
                    found[asset] = {k: v.value for k, v in event.asset_materialization.metadata.items()}
            for partition in DATASETS:
                [record] = instance.fetch_materializations(
                    dg.AssetRecordsFilter(dg.AssetKey("responses"), asset_partitions=[partition]), limit=1
                ).records
                materialization = record.asset_materialization
                assert materialization is not None
                found[f"responses/{partition}"] = {k: v.value for k, v in materialization.metadata.items()}
            records = instance.fetch_observations(dg.AssetKey("inference_server"), limit=1000, ascending=True).records
            events = []
            for record in records:
                observation = record.asset_observation
                assert observation is not None
                metadata = {k: v.value for k, v in observation.metadata.items()}
                if "event" in metadata:  # a start, stop or reuse (not a health report)
                    events.append(metadata)
            return found, events


@pytest.fixture(scope="module")
def run(real_vllm_python: Path, local_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PipelineRun]:
    root = tmp_path_factory.mktemp("vllm_main_job")
    port = free_port()
    config = pipeline_file(root, local_model, real_vllm_python, port)
    home = root / "home"
    try:
        result = cli(config, home, "run", timeout_s=CLI_TIMEOUT_S)
        status = cli(config, home, "server", "status")
    finally:
        stop = cli(config, home, "server", "stop")
    assets = ["training_data", "hidden_states", "drafter_eval", "drafter_benchmark", "served_drafter"]
    metadata, events = instance_records(home, assets)
    log = root / "serving" / f"managed-{port}.log"
    yield PipelineRun(result, status, stop, root / "out", log, store_server_layers(local_model), port, metadata, events)


def test_main_job_through_a_managed_real_vllm(run: PipelineRun) -> None:
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

    # the tools partition's probes passed on the managed server's hermes parser (the refusal without one:
    # test_target_alone.py)
    probes = {c["capability"]: c["status"] for c in run.metadata["responses/B2_tools"]["server_capabilities"]}
    assert probes == {"tool_call_parser": "ok", "reasoning_parser": "unknown", "context_length": "ok", "tokenize": "ok"}

    served = until_shutdown(run.server_log.read_text(errors="replace"))
    assert "Traceback" not in served, served[-3000:]
    print(result.stdout[result.stdout.index("dataset") :])
    print(
        f"validation: {states['serving_validation_detail']} (agreement {states['serving_agreement']}, "
        f"{states['serving_near_ties']} near-ties apart); tokenizer: {training['tokenizer_agreement_detail']}"
    )


def test_every_start_and_stop_is_an_observation_with_its_reason_and_duration(run: PipelineRun) -> None:
    """From no server to the served drafter: who held the GPUs when, as the UI shows it."""
    assert run.result.returncode == 0, run.result.stderr[-3000:]
    for event in run.events:
        print(f"{event['event']:>8} {event['role']:<22} {event['duration_s']:>7.1f} s  {event['reason']}")
    moves = [(e["event"], e["role"]) for e in run.events if e["event"] != "kept"]
    assert moves == [
        ("started", "generation"),
        ("stopped", "generation"),
        ("started", "extraction"),
        ("stopped", "extraction"),
        ("started", "benchmark-baseline"),
        ("stopped", "benchmark-baseline"),
        ("started", "benchmark-speculative"),
        ("stopped", "benchmark-speculative"),
        ("started", served_role(run)),
    ]
    kept = [e for e in run.events if e["event"] == "kept"]
    assert [e["role"] for e in kept] == ["generation"] * (len(DATASETS) - 1)  # the other partitions
    starts = [e for e in run.events if e["event"] == "started"]
    assert [e["role"] for e in starts] == [*ROLES[:-1], served_role(run)] and all(e["duration_s"] > 0 for e in starts)
    assert all(e["verified"] and e["signals"] == ["TERM"] for e in run.events if e["event"] == "stopped")
    assert starts[0]["reason"] == f"responses {next(iter(DATASETS))}"
    extraction = starts[1]
    assert extraction["reason"] == "hidden_states needs the extraction server"
    # the extraction server's ids are the store's, in its launch line, not typed by anyone
    assert f'"eagle_aux_hidden_state_layer_ids": {json.dumps(run.server_layers)}' in extraction["command"]
    assert "--speculative-config" in starts[3]["command"] and "--tool-call-parser hermes" in starts[4]["command"]
    assert run.events[-1]["gpus_held_by"] == served_role(run)


def served_role(run: PipelineRun) -> str:
    """What served_drafter starts: the drafter when the benchmark found it faster than the target alone, else
    the target alone (the generation line); which one depends on this machine's speed, the rule does not."""
    return "generation" if run.metadata["drafter_benchmark"]["chosen"] == "baseline" else "served-drafter"


def test_the_served_drafter_and_its_tau_from_the_servers_counters(run: PipelineRun) -> None:
    assert run.result.returncode == 0, run.result.stderr[-3000:]
    served = run.metadata["served_drafter"]
    bench = run.metadata["drafter_benchmark"]
    print(f"drafter_benchmark chose {bench['chosen']}: {bench['choice']['reason']}")
    if bench["chosen"] == "baseline":
        assert served["decision"] == f"the target is served without a drafter: {bench['choice']['reason']}"
        assert served["served_drafter"] == "none: the target alone" and served["tau_served"] is None
        record = json.loads((run.out / "served_drafter.json").read_text())
        assert record["current"] is None and record["baseline_reason"] == bench["choice"]["reason"]
        return
    assert served["decision"] == "served the new drafter: no drafter is served yet"
    assert 1.0 <= served["tau_served"] <= STEPS + 1 and served["tau_served_verify_steps"] > 0
    assert served["served_drafter"].startswith(f"{run.out}/drafter/served/")
    assert served["candidate_tau_eval"] == pytest.approx(run.metadata["drafter_eval"][f"tau@{STEPS}/all"])
    assert served["candidate_tau_benchmark"] == pytest.approx(run.metadata["drafter_benchmark"]["tau_server"])
    record = json.loads((run.out / "served_drafter.json").read_text())
    assert " ".join(record["current"]["argv"]) == served["command"] and record["previous"] is None
    print(
        f"served drafter τ@{STEPS} from vLLM's counters {served['tau_served']:.4f} over {served['tau_served_prompts']} "
        f"eval prompts ({served['tau_served_verify_steps']} verify steps); drafter_eval {served['candidate_tau_eval']}"
        f", benchmark {served['candidate_tau_benchmark']}"
    )


def test_server_status_then_stop_leaves_no_process(run: PipelineRun) -> None:
    assert run.status.returncode == 0, run.status.stdout + run.status.stderr
    role = served_role(run)
    assert f"on port {run.port}: running" in run.status.stdout and f"role {role}" in run.status.stdout
    assert run.stop.returncode == 0, run.stop.stdout + run.stop.stderr
    assert f"stopped the {role} server" in run.stop.stdout
    assert f"0 process(es) of it left; port {run.port} free" in run.stop.stdout
    print(run.status.stdout + run.stop.stdout)
    pid = next(e["pid"] for e in reversed(run.events) if e["event"] == "started")
    assert processes_of(pid) == []


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
        assert f"--port {run.port}" in arm["server_process"], arm["server_process"]
    assert "--speculative-config" in speculative["server_process"]

    steps = speculative["verify_steps"]
    [base_level], [spec_level] = baseline["levels"], speculative["levels"]
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
        f"tokens/s speculative/baseline {bench['speedup']:.3f} [{bench['speedup_low']:.3f}, "
        f"{bench['speedup_high']:.3f}] ({spec_level['tokens_per_s']:.1f} / {base_level['tokens_per_s']:.1f}); "
        f"completion tokens {base_level['completion_tokens']} / {spec_level['completion_tokens']}"
    )
    assert abs(bench["tau_server"] - offline) <= bound
    assert bench["speedup"] > 0
