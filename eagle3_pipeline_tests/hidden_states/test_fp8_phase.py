"""``hidden_states.storage_dtype: float8_e4m3`` through the phase and the assets, with the real tiny
target (SmolLM2-135M-Instruct, the stand-in for the 1T target) on real training_data shards: a
bf16 store is refused (then replaced with overwrite), the spot check compares like with like at
the default tolerance and still catches misplaced states, and hidden_states → eagle3_drafter
materialize on a real (ephemeral) Dagster instance from an fp8 store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import dagster as dg

from eagle3_pipeline.components.eagle3.eagle3_drafter import build_drafter_assets
from eagle3_pipeline.components.eagle3.hidden_states import build_eagle3_assets
from eagle3_pipeline.config import load_config
from eagle3_pipeline.hidden_states.capture import load_target
from eagle3_pipeline.hidden_states.extract import run
from eagle3_pipeline.hidden_states.extract_spec import ExtractionError
from eagle3_pipeline.hidden_states.spot_check import spot_check
from eagle3_pipeline.hidden_states.store import AUX_KEY, FP8, HiddenStateStore, ShardFile
from eagle3_pipeline.testing.extract_specs import extract_spec
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.training_data import sample_rows, write_training_data
from eagle3_pipeline_tests.dagster_runs import pipeline_resources
from eagle3_pipeline_tests.pipeline_files import TINY_TARGET, write_pipeline

pytestmark = [pytest.mark.slow, pytest.mark.local_model]


def spec(data: Path, output: Path, model: Path, **settings: Any) -> dict[str, Any]:
    return extract_spec(data, output, model, "SmolLM2-135M-Instruct", device="cpu", shard_tokens=30, **settings)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    train = [sample_rows("a", 4, seed=1, max_len=14), sample_rows("b", 2, seed=2, max_len=14)]
    return write_training_data(
        tmp_path / "training_data", {"train": train, "eval": [sample_rows("e", 2, seed=3, max_len=14)]}
    )


def test_fp8_store_refuses_a_bf16_store_and_its_spot_check_still_catches_shifted_states(
    data: Path, tmp_path: Path, local_model: Path
) -> None:
    out = tmp_path / "store"
    run(spec(data, out, local_model, spot_check_samples=0), Recorder())
    with pytest.raises(ExtractionError, match=r"dtype: store has 'bfloat16', expected 'float8_e4m3'.*overwrite"):
        run(spec(data, out, local_model, storage_dtype=FP8, spot_check_samples=0), Recorder())
    meta = run(spec(data, out, local_model, storage_dtype=FP8, spot_check_samples=3, overwrite=True), Recorder())
    assert meta["storage_dtype"] == FP8 and meta["shards_reused"] == 0 and HiddenStateStore(out).manifest().dtype == FP8
    assert meta["bytes_per_token_formula"] == 4 * (576 + 4) + 5 and abs(meta["bytes_per_token_ratio"] - 1) < 0.05
    assert meta["disk_training_data_bytes"] == meta["tokens"] * meta["bytes_per_token_formula"]
    assert meta["spot_check_passed"] and meta["spot_check_samples"] == 3 and meta["spot_check_max_rel_error"] < 0.01
    assert ShardFile(out / "shard-00000.safetensors").dtype == FP8
    with pytest.raises(ExtractionError, match=r"dtype: store has 'float8_e4m3', expected 'bfloat16'"):
        run(spec(data, out, local_model, spot_check_samples=0), Recorder())

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shard = out / "shard-00000.safetensors"
    with safe_open(str(shard), framework="pt") as handle:
        header = handle.metadata()
    tensors = load_file(str(shard))
    tensors[AUX_KEY] = tensors[AUX_KEY].roll(1, dims=0)  # states shifted by one token: a plausible bug
    save_file(tensors, str(shard), metadata=header)
    target = load_target(str(local_model), "SmolLM2-135M-Instruct", "cpu", "auto", False)
    verdict = spot_check(HiddenStateStore(out), target, [1, 14, 26], 8, 0.01, FP8)
    assert not verdict["spot_check_passed"] and verdict["spot_check_max_rel_error"] > 0.1


def _evaluations(result: dg.ExecuteInProcessResult) -> dict[str, bool]:
    return {e.check_name: e.passed for e in result.get_asset_check_evaluations()}


def test_hidden_states_then_the_drafter_from_an_fp8_store(tmp_path: Path, local_model: Path) -> None:
    hidden_states = {
        "shard_tokens": 20,
        "spot_check_samples": 1,
        "device": "cpu",
        "storage_dtype": "float8_e4m3",
        "validation": {"samples": 0},
    }
    drafter = {
        "ttt_steps": 2,
        "epochs": 2,
        "batch_tokens": 64,
        "max_seq_len": 16,
        "log_every": 1,
        "checkpoint_every": 100,
        "lr": 0.003,
        "nproc_per_node": 1,
    }
    sections = {"draft_vocab": {"size": 64}, "hidden_states": hidden_states, "drafter": drafter}
    path = write_pipeline(tmp_path, TINY_TARGET, sections)
    config = load_config(path)
    train, evals = [sample_rows("a", 4, seed=1, max_len=12)], [sample_rows("e", 1, seed=2, max_len=12)]
    write_training_data(config.artifacts_root / "training_data", {"train": train, "eval": evals})
    assets = [*build_eagle3_assets(config), *build_drafter_assets(config)]
    result = dg.materialize(assets, instance=dg.DagsterInstance.ephemeral(), resources=pipeline_resources(path))
    assert result.success
    # Random ids, so no serving server to compare with: the validation is off and says so (a failing WARN).
    assert _evaluations(result) == {
        "coverage": True,
        "spot_check": True,
        "serving_agreement": False,
        "bytes_per_token": True,
    }
    states: dict[str, Any] = {
        k: v.value for k, v in result.asset_materializations_for_node("hidden_states")[0].metadata.items()
    }
    assert states["storage_dtype"] == FP8 and states["bytes_per_token_formula"] == 2325
    assert HiddenStateStore(config.artifacts_root / "hidden_states").manifest().dtype == FP8
    drafter = result.asset_materializations_for_node("eagle3_drafter")[0].metadata
    first, last = drafter["first_loss"].value, drafter["last_loss"].value
    assert isinstance(first, float) and isinstance(last, float) and torch.isfinite(torch.tensor([first, last])).all()
    assert (config.artifacts_root / "drafter" / "export" / "model.safetensors").is_file()
