"""The online benchmark against a loopback fake of SGLang/vLLM started by the configured command on
the local host (the real hosts layer, the real health gate). Not run against a real GPU server here."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.components.eagle3.drafter_benchmark import build_drafter_benchmark
from eagle3_pipeline.drafter.serve.benchmark import benchmark_settings, eval_prompts, make_gate, run_benchmark
from eagle3_pipeline.drafter.serve.client import BenchmarkError
from eagle3_pipeline.drafter.serve.prompt_sets import BenchPrompt
from eagle3_pipeline.drafter.serve.servers import RemoteServer, launch_command
from eagle3_pipeline.drafter.serve.set_tau import PromptSetRun, SetSettings
from eagle3_pipeline.drafter.serve.sweep import SpeculativeConfig
from eagle3_pipeline.health.gate import UnhealthyError, thresholds_for
from eagle3_pipeline.hosts import LocalHost
from eagle3_pipeline.hosts.identity import ProcessIdentity
from eagle3_pipeline.inference.embedded import free_port
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline_tests.dagster_runs import pipeline_resources
from eagle3_pipeline_tests.pipeline_files import load_pipeline

# Its scripted servers run as `python -m sglang.launch_server …`: the health tests would see them.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("process_table")]

REPO = Path(__file__).resolve().parents[3]
FAKE = f"cd {shlex.quote(str(REPO))} && {shlex.quote(sys.executable)} -m eagle3_pipeline_tests.drafter.fake_spec_server"


def bench_sections(tmp_path: Path, server: str) -> dict[str, Any]:
    """A `drafter_benchmark` of the scripted `server`, on this machine, and the one-prompt source of B1."""
    write_jsonl(tmp_path / "B1.jsonl", [sharegpt("question")])
    port = free_port()
    return {
        "name": "bench",
        "target": {"model": "fake-target", "tokenizer": None},
        # this machine stands in for the GPU host: no GPU expected (the builder's floors are low)
        "health": {"host": {"kind": "local"}, "expected_gpus": 0},
        "drafter_benchmark": {
            "server": server,
            "target_model_path": "/models/target with space",
            "draft_model_path": "/models/drafter",
            "port": port,
            "steps": 3,
            "launch_command": FAKE + f" --kind {server} --port {{port}} {{speculative}}",
            "speculative_args": "--speculative-steps {steps} --tokens-per-step 3 --step-delay-s 0.002",
            "process_pattern": "eagle3_pipeline_tests\\.drafter\\.fake_spec_server",
            "log_dir": str(tmp_path / "logs"),
            "prompts": 6,
            "max_tokens": 20,
            "concurrencies": [1, 2],
            "sweep_steps": [],
            "max_server_starts": 2,
            "startup_timeout_s": 60,
        },
    }


def write_eval_shard(folder: Path) -> Path:
    folder.mkdir(parents=True)
    rows = [
        {"input_ids": [1, 2, 3, 40, 41, 2], "loss_mask": [0, 0, 0, 1, 1, 1]},
        {"input_ids": [1, 5, 50], "loss_mask": [0, 0, 1]},
        {"input_ids": [1, 6, 7], "loss_mask": [0, 0, 0]},  # no generated turn: skipped
    ]
    table = pa.table(
        {
            "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int32())),
            "loss_mask": pa.array([r["loss_mask"] for r in rows], pa.list_(pa.int8())),
        }
    )
    pq.write_table(table, folder / "eval-00000.parquet")
    return folder


def test_default_launch_commands_quote_every_value(tmp_path: Path) -> None:
    config = load_pipeline(
        tmp_path,
        bench_sections(tmp_path, "sglang"),
        {"drafter_benchmark": {"launch_command": None, "speculative_args": None}},
        runtime_checks=True,
    )
    settings = config.drafter_benchmark
    assert settings is not None
    assert launch_command(settings, None) == (
        "python -m sglang.launch_server --model-path '/models/target with space' --host 127.0.0.1 "
        f"--port {settings.port} --tp-size 1"
    )
    assert launch_command(settings, SpeculativeConfig(3)).endswith(
        "--speculative-algorithm EAGLE3 --speculative-draft-model-path /models/drafter --speculative-num-steps 3 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
    )
    assert launch_command(settings, SpeculativeConfig(5, 4, 16)).endswith(
        "--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16"
    )
    vllm = settings.model_copy(update={"server": "vllm"})
    assert launch_command(vllm, SpeculativeConfig(3)).endswith(
        '--speculative-config \'{"method": "eagle3", "model": "/models/drafter", "num_speculative_tokens": 3}\''
    )


def test_an_unknown_placeholder_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"drafter_benchmark.launch_command: .*unknown placeholder\(s\) \['model'\]"):
        load_pipeline(
            tmp_path,
            bench_sections(tmp_path, "sglang"),
            {"drafter_benchmark": {"launch_command": "serve {model}"}},
            runtime_checks=True,
        )


def test_eval_prompts_are_cut_at_the_first_generated_token(tmp_path: Path) -> None:
    folder = write_eval_shard(tmp_path / "training_data")
    assert eval_prompts(folder, 10) == [[1, 2, 3], [1, 5]]
    assert eval_prompts(folder, 1) == [[1, 2, 3]]
    with pytest.raises(BenchmarkError, match="materialize training_data first"):
        eval_prompts(tmp_path / "none", 1)


@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_benchmark_reads_tau_as_each_server_reports_it(tmp_path: Path, server: str) -> None:
    config = load_pipeline(tmp_path, bench_sections(tmp_path, server), runtime_checks=True)
    settings = config.drafter_benchmark
    assert settings is not None
    host = LocalHost()
    recorder = Recorder()
    prompts = [[1, 2, 3]] * settings.prompts
    base_url = f"http://127.0.0.1:{settings.port}"
    result = run_benchmark(
        settings,
        host,
        base_url=base_url,
        prompts=prompts,
        gate=make_gate(host, thresholds_for(config.health, config.artifacts_root)),
        report=recorder,
    )
    [speculative] = result.arms
    # 20 tokens per request at 3 per verify step: 7 steps (6 × 3 + 2) -> τ = 20/7 (SGLang);
    # vLLM: 1 + accepted/drafts = 1 + (20 - 7)/7, the same figure; over both concurrencies' 2 × 6 requests
    assert speculative.tau == pytest.approx(20 / 7)
    assert result.baseline.tau is None and speculative.config == SpeculativeConfig(3)
    for arm in (result.baseline, speculative):
        assert [m.concurrency for m in arm.levels] == [1, 2]
        for level in arm.levels:
            assert level.completion_tokens == 6 * 20 and level.tokens_per_s > 0
            # the tokens as the engine counts them, with their ids, the prompt each answered, and when they came
            assert [r.prompt for r in level.records] == list(range(6))
            assert all(len(r.token_ids) == r.completion_tokens == 20 for r in level.records)
            assert all(r.ttft_s is not None and r.itl_s is not None and r.latency_s >= r.ttft_s for r in level.records)
    metadata = result.as_metadata()
    assert metadata["tau_server"] == round(20 / 7, 4) and metadata["requests"] == 6
    assert (
        metadata["serve_concurrency"] == 2
        and metadata["speedup_low"] <= metadata["speedup"] <= metadata["speedup_high"]
    )
    acceptance = speculative.acceptance
    assert acceptance is not None and acceptance.no_verify_requests == 0
    if server == "vllm":
        # per request 7 steps: six accept 2 drafts (positions 0 and 1), the last one 1 (position 0)
        assert acceptance.per_position == pytest.approx([1.0, 6 / 7, 0.0])
        assert (acceptance.verify_steps, acceptance.accepted_tokens) == (12 * 7, 12 * 13)
        assert [metadata[f"accept_d{j}"] for j in (1, 2, 3)] == [1.0, round(6 / 7, 4), 0.0]
        assert metadata["acceptance_pos1"] == round(6 / 7, 4)
    else:
        assert acceptance.per_position is None and "accept_d1" not in metadata
    # the gate found the fake by the configured pattern, and says which process that was (a pattern makes
    # an SGLang server custom, without the per-rank check; a vLLM server stays vllm)
    kind = "vllm" if server == "vllm" else "custom"
    for arm in (result.baseline, speculative):
        assert arm.server_process.startswith(f"{kind} server pid ") and "fake_spec_server" in arm.server_process
    assert [(p["arm"], p["concurrency"]) for p in recorder.points] == [
        ("baseline", 1),
        ("baseline", 2),
        ("speculative-K3-top1-4", 1),
        ("speculative-K3-top1-4", 2),
    ]
    # both servers were stopped: nothing answers on the port any more
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base_url}/v1/models", timeout=2)


@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_prompt_sets_are_measured_per_category_on_the_speculative_arm(tmp_path: Path, server: str) -> None:
    """The benchmark's wiring of the prompt sets (eagle3_pipeline.drafter.serve.set_tau): measured on the speculative
    arm's server after its timed run, per category, into the arm's result and the metadata's ``tau_sets``."""
    config = load_pipeline(tmp_path, bench_sections(tmp_path, server), runtime_checks=True)
    settings = config.drafter_benchmark
    assert settings is not None
    host = LocalHost()
    sets = PromptSetRun(
        [BenchPrompt("held_out", "chat", "a", (1, 2)), BenchPrompt("held_out", "code", "b", (3,))],
        None,
        SetSettings(max_tokens=20, concurrency=2),
    )
    result = run_benchmark(
        settings,
        host,
        base_url=f"http://127.0.0.1:{settings.port}",
        prompts=[[1, 2, 3]],
        gate=make_gate(host, thresholds_for(config.health, config.artifacts_root)),
        report=Recorder(),
        sets=sets,
    )
    assert result.baseline.prompt_sets is None and result.arms[0].prompt_sets is not None
    assert all(arm.prompt_sets is None for arm in result.arms[1:])
    rows = result.as_metadata()["tau_sets"]
    assert [(r["category"], r["requests"], r["tau"], r["tau_with_loops"], r["loops"]) for r in rows] == [
        ("chat", 1, round(20 / 7, 4), round(20 / 7, 4), 0),
        ("code", 1, round(20 / 7, 4), round(20 / 7, 4), 0),
    ]


def test_the_health_gate_refuses_before_any_server_starts(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, bench_sections(tmp_path, "sglang"), runtime_checks=True)
    sick = config.model_copy(update={"health": config.health.model_copy(update={"min_disk_free_gb": 1e9})})
    settings = config.drafter_benchmark
    assert settings is not None
    host = LocalHost()
    with pytest.raises(UnhealthyError, match="disk"):
        run_benchmark(
            settings,
            host,
            base_url=f"http://127.0.0.1:{settings.port}",
            prompts=[[1]],
            gate=make_gate(host, thresholds_for(sick.health, sick.artifacts_root)),
            report=Recorder(),
        )
    assert not (tmp_path / "logs").exists()


def test_a_server_that_dies_at_start_fails_with_its_log(tmp_path: Path) -> None:
    config = load_pipeline(
        tmp_path,
        bench_sections(tmp_path, "sglang"),
        {"drafter_benchmark": {"launch_command": "echo model weights not found; exit 3"}},
        runtime_checks=True,
    )
    settings = config.drafter_benchmark
    assert settings is not None
    host = LocalHost()
    with pytest.raises(BenchmarkError, match="(?s)exited during start-up.*model weights not found"):
        run_benchmark(
            settings,
            host,
            base_url=f"http://127.0.0.1:{settings.port}",
            prompts=[[1]],
            gate=make_gate(host, thresholds_for(config.health, config.artifacts_root)),
            report=Recorder(),
        )


def test_drafter_benchmark_asset_materializes_against_the_fake(tmp_path: Path, dagster_home: Path) -> None:
    config = load_pipeline(tmp_path, bench_sections(tmp_path, "sglang"), runtime_checks=True)
    write_eval_shard(tmp_path / "out" / "training_data")
    assets = build_drafter_benchmark(config)
    with dg.DagsterInstance.get() as instance:
        result = dg.materialize(assets, instance=instance, resources=pipeline_resources(config.source_file))
        assert result.success
        metadata: dict[str, Any] = {
            k: v.value
            for k, v in result.get_asset_materialization_events()[
                0
            ].step_materialization_data.materialization.metadata.items()
        }
    assert metadata["tau_server"] == round(20 / 7, 4)
    assert metadata["requests"] == 2  # the eval shard has two prompts
    assert metadata["speedup"] > 0
    assert build_drafter_benchmark(config.model_copy(update={"drafter_benchmark": None})) == []


def test_a_recorded_benchmark_of_the_same_drafter_starts_no_server(tmp_path: Path, dagster_home: Path) -> None:
    """A rerun with the same drafter (by content), prompts and settings reuses the recorded result: no
    server starts (its logs stay as the first run left them) and the health gate is not asked; a
    retrained drafter runs the benchmark again."""
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (drafter / "model.safetensors").write_bytes(b"weights v1")
    config = load_pipeline(
        tmp_path,
        bench_sections(tmp_path, "vllm"),
        {"drafter_benchmark": {"draft_model_path": str(drafter)}},
        runtime_checks=True,
    )
    write_eval_shard(tmp_path / "out" / "training_data")
    assets = build_drafter_benchmark(config)

    def materialize() -> dict[str, Any]:
        with dg.DagsterInstance.get() as instance:
            result = dg.materialize(assets, instance=instance, resources=pipeline_resources(config.source_file))
        assert result.success
        [materialization] = result.asset_materializations_for_node("drafter_benchmark")
        return {k: v.value for k, v in materialization.metadata.items()}

    first = materialize()
    logs = {p.name: (p.stat().st_mtime_ns, p.read_text()) for p in (tmp_path / "logs").iterdir()}
    assert set(logs) == {"baseline.log", "speculative-K3-top1-4.log"} and first["reused"] is False

    again = materialize()
    assert again["reused"] is True
    assert {k: again[k] for k in ("tau_server", "speedup", "requests")} == {
        k: first[k] for k in ("tau_server", "speedup", "requests")
    }
    assert {p.name: (p.stat().st_mtime_ns, p.read_text()) for p in (tmp_path / "logs").iterdir()} == logs, (
        "no server was started"
    )

    (drafter / "model.safetensors").write_bytes(b"weights v2")
    assert materialize()["reused"] is False, "another drafter is benchmarked again"


def test_the_servers_logs_default_to_a_private_folder_under_the_artifacts_root(tmp_path: Path) -> None:
    config = load_pipeline(
        tmp_path, bench_sections(tmp_path, "vllm"), {"drafter_benchmark": {"log_dir": None}}, runtime_checks=True
    )
    settings, _ = benchmark_settings(config)
    assert settings.log_dir == f"{tmp_path / 'out'}/benchmark"
    server = RemoteServer(LocalHost(), "sleep 300", f"{settings.log_dir}/baseline.log")
    server.start()
    try:
        assert oct((tmp_path / "out" / "benchmark").stat().st_mode & 0o777) == "0o700" and server.alive()
    finally:
        server.stop()
    assert not server.alive()


def test_a_log_folder_others_can_write_or_a_log_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(BenchmarkError, match=r"drafter_benchmark\.log_dir: the state folder .*/open on localhost is"):
        RemoteServer(LocalHost(), "sleep 300", f"{tmp_path / 'open'}/baseline.log").start()
    (tmp_path / "logs").mkdir(mode=0o700)
    (tmp_path / "victim").write_text("precious\n")
    (tmp_path / "logs" / "baseline.log").symlink_to(tmp_path / "victim")
    with pytest.raises(BenchmarkError, match="the log is a symbolic link: refused"):
        RemoteServer(LocalHost(), "sleep 300", f"{tmp_path / 'logs'}/baseline.log").start()
    assert (tmp_path / "victim").read_text() == "precious\n"


def test_a_stop_leaves_a_process_that_reused_the_servers_pid_alone(tmp_path: Path) -> None:
    """The server exited; its pid now names a bystander in a session of its own, started later."""
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        stat = Path(f"/proc/{bystander.pid}/stat").read_text().rpartition(")")[2].split()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        server = RemoteServer(LocalHost(), "sleep 300", f"{tmp_path}/logs/baseline.log")
        server.identity = ProcessIdentity(bystander.pid, int(stat[19]) - 5, boot)
        server.stop()
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
