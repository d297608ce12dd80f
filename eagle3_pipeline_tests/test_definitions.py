"""The code location loads fast (no torch/transformers), validates, and has the agreed shape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dagster as dg

from eagle3_pipeline.config import load_config, local_profile_path
from eagle3_pipeline.defs.definitions import build_definitions

REPO = Path(__file__).resolve().parents[1]


def test_loading_definitions_imports_no_heavy_library() -> None:
    code = (
        "import sys, eagle3_pipeline.definitions as d; "
        "d.defs.resolve_asset_graph(); "
        "print(sorted(m for m in ('torch', 'transformers', 'accelerate', 'gguf') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_dagster_definitions_validate(tmp_path: Path) -> None:
    dagster = Path(sys.executable).parent / "dagster"
    out = subprocess.run(
        [str(dagster), "definitions", "validate", "-m", "eagle3_pipeline.definitions"],
        capture_output=True, text=True, cwd=REPO, env={"PATH": "/usr/bin:/bin", "DAGSTER_HOME": str(tmp_path), "HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_asset_graph_partitions_and_lineage(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(local_profile_path())
    graph = build_definitions(config).resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys >= {"target_model", "prompts", "responses", "training_data", "inference_server"}
    drafter_eval = graph.get(dg.AssetKey("drafter_eval"))
    assert {p.to_user_string() for p in drafter_eval.parent_keys} == {"eagle3_drafter", "hidden_states", "draft_vocab"}
    assert graph.get_check_spec(dg.AssetCheckKey(dg.AssetKey("drafter_eval"), "tau_regression")).blocking
    responses = graph.get(dg.AssetKey("responses"))
    assert responses.partitions_def.get_partition_keys() == config.dataset_ids
    assert {p.to_user_string() for p in responses.parent_keys} == {"prompts", "target_model"}
    assert responses.pools == {"gpu"}
    assert {p.to_user_string() for p in graph.get(dg.AssetKey("training_data")).parent_keys} == {"responses"}
