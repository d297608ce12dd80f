"""The shipped Kimi-K2.5 profile (`profiles/kimi-k25.yaml`): the box this pipeline was designed
around. It must load and validate as Dagster definitions on a machine that reaches none of its
hosts (no SSH, no SGLang, no router key set)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_pipeline.config import load_config
from eagle3_pipeline.defs.pipeline import build_definitions
from eagle3_pipeline_tests.locations import location_file

REPO = Path(__file__).resolve().parents[1]
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
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} >= {"responses", "hidden_states", "eagle3_drafter"}


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
