"""The shipped Kimi-K2.5 profile (`profiles/kimi-k25.yaml`): the box this pipeline was designed
around, its SGLang server run by the pipeline. It must load and validate as Dagster definitions on a
machine that reaches none of its hosts (no SSH, no SGLang, no router key set)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import load_config
from eagle3_pipeline.config.phases import GPU_PHASES
from eagle3_pipeline.drafter.serve.benchmark import benchmark_settings
from eagle3_pipeline.managed import EagleDrafter, ServerPurpose, launch_for, managed_server
from eagle3_pipeline.managed.phases import gpu_phase_server
from eagle3_pipeline_tests.locations import location_file

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "eagle3_pipeline" / "profiles" / "kimi-k25.yaml"


def test_the_profile_describes_the_kimi_box() -> None:
    config = load_config(PROFILE, runtime_checks=False)
    assert config.target.trust_remote_code
    assert config.dataset_ids == [
        f"B{i}_{name}"
        for i, name in enumerate(
            ["sharegpt", "ultrachat", "tools", "code", "math", "long", "multilingual", "agentic"], start=1
        )
    ]
    assert (config.generation.concurrency.short, config.generation.concurrency.long) == (150, 32)
    assert config.health.server is not None and config.health.server.tp_size == 8 and config.health.expected_gpus == 8
    assert config.health.host.kind == "ssh" and config.compute.kind == "ssh"
    gpu_box, hosted = config.inference.endpoints
    assert config.failover_order() == [0, 1]
    assert gpu_box.api_key_env is None and hosted.api_key_env and hosted.price is not None
    assert config.training_data.reasoning == "emit" and config.generation.reasoning == "keep"
    graph = build_definitions(config).resolve_asset_graph()
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} >= {
        "responses",
        "hidden_states",
        "eagle3_drafter",
        "drafter_benchmark",
        "served_drafter",
    }


def test_the_profile_runs_its_sglang_server_with_no_edit() -> None:
    """Managed SGLang TP 8 with Kimi's parsers named (no local config.json needed), the in-process SGLang
    capture (transformers refuses the INT4 target), and the benchmark's arms and the served drafter on the
    managed server's launch lines, every GPU phase on the server's machine."""
    config = load_config(PROFILE, runtime_checks=False)
    setup = managed_server(config)
    assert setup is not None and setup.engine == "sglang" and setup.serving.tp_size == 8
    assert setup.base_url == "http://gpu-box.internal:30000/v1" == config.inference.endpoints[0].base_url
    assert config.health.server is not None and config.health.server.log_path == setup.serving.log_path
    assert config.hidden_states.backend == "sglang" and config.hidden_states.tp_size == 8
    for phase in GPU_PHASES:
        assert gpu_phase_server(config, phase) == setup, phase
    tools = "--reasoning-parser kimi_k2 --tool-call-parser kimi_k2"
    assert tools in launch_for(config.target, setup, ServerPurpose.generation(needs_tools=True)).shell()
    settings, managed = benchmark_settings(config)
    assert managed == setup and settings.target_model_path == "/models/Kimi-K2.5"
    assert settings.draft_model_path == "/data/eagle3/kimi_k25/drafter/export"  # compute.artifacts_root
    speculative = launch_for(config.target, setup, ServerPurpose.benchmark(EagleDrafter(settings.draft_model_path, 3)))
    assert "--speculative-num-draft-tokens 4" in speculative.shell() and "--reasoning-parser" not in speculative.argv


@pytest.mark.slow
def test_dagster_definitions_validate_with_the_profile(tmp_path: Path) -> None:
    dagster = Path(sys.executable).parent / "dagster"
    env = {"PATH": "/usr/bin:/bin", "DAGSTER_HOME": str(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run(
        [str(dagster), "definitions", "validate", "-f", str(location_file(tmp_path, PROFILE))],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
