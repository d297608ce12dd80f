"""`draft_vocab` and `hidden_states` as Dagster assets on a real (ephemeral) instance, with the
real tiny target; their checks pass on good data and block when they fail."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_pipeline.components.eagle3.hidden_states import build_eagle3_assets
from eagle3_pipeline.testing.training_data import sample_rows, write_training_data
from eagle3_pipeline_tests.dagster_runs import pipeline_resources
from eagle3_pipeline_tests.pipeline_files import TINY_TARGET, load_pipeline

pytestmark = pytest.mark.local_model


def pipeline(tmp_path: Path, sections: dict[str, Any]) -> list[dg.AssetsDefinition | dg.AssetChecksDefinition]:
    config = load_pipeline(tmp_path, TINY_TARGET, sections, runtime_checks=True)
    train, evals = [sample_rows("a", 3, seed=1, max_len=12)], [sample_rows("e", 1, seed=2, max_len=12)]
    write_training_data(config.artifacts_root / "training_data", {"train": train, "eval": evals})
    return build_eagle3_assets(config)


def evaluations(result: dg.ExecuteInProcessResult) -> dict[str, bool]:
    return {e.check_name: e.passed for e in result.get_asset_check_evaluations()}


@pytest.mark.slow
def test_both_assets_materialize_and_their_checks_pass(tmp_path: Path, local_model: Path) -> None:
    # Random ids: no serving server could be compared with (test_validation.py does that), so the
    # validation is off and its check says so, as a failing WARN that does not stop the run.
    hidden_states = {"shard_tokens": 20, "spot_check_samples": 1, "device": "cpu", "validation": {"samples": 0}}
    assets = pipeline(tmp_path, {"hidden_states": hidden_states})
    result = dg.materialize(
        assets, instance=dg.DagsterInstance.ephemeral(), resources=pipeline_resources(tmp_path / "pipeline.yaml")
    )
    assert result.success
    assert evaluations(result) == {
        "coverage": True,
        "spot_check": True,
        "serving_agreement": False,
        "bytes_per_token": True,
    }
    [unvalidated] = [e for e in result.get_asset_check_evaluations() if e.check_name == "serving_agreement"]
    assert unvalidated.severity == dg.AssetCheckSeverity.WARN and "not validated" in (unvalidated.description or "")
    meta = result.asset_materializations_for_node("hidden_states")[0].metadata
    assert meta["samples"].value == 4 and meta["layer_convention"].value == "output_of_layer"
    assert (
        str(meta["training_data_version"].value).startswith("sha256:") and meta["aux_layer_ids"].value == "[1, 14, 26]"
    )
    vocab = result.asset_materializations_for_node("draft_vocab")[0].metadata
    assert vocab["draft_vocab_size"].value == 12288 and vocab["coverage"].value == 1.0
    observed = [e for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"]
    assert observed and "shards_done" in observed[-1].asset_observation_data.asset_observation.metadata


def test_failed_checks_block_the_run(tmp_path: Path, local_model: Path) -> None:
    hidden_states = {
        "shard_tokens": 100,
        "spot_check_samples": 1,
        "spot_check_tolerance": 1.0e-12,
        "device": "cpu",
        "validation": {"samples": 0},
    }
    extra = {"draft_vocab": {"size": 2}, "hidden_states": hidden_states}
    assets = pipeline(tmp_path, extra)
    resources = pipeline_resources(tmp_path / "pipeline.yaml")
    vocab = dg.materialize(
        assets,
        selection=["draft_vocab"],
        instance=dg.DagsterInstance.ephemeral(),
        resources=resources,
        raise_on_error=False,
    )
    assert not vocab.success and evaluations(vocab) == {"coverage": False}
    states = dg.materialize(
        assets,
        selection=["hidden_states"],
        instance=dg.DagsterInstance.ephemeral(),
        resources=resources,
        raise_on_error=False,
    )
    assert not states.success and evaluations(states)["spot_check"] is False
