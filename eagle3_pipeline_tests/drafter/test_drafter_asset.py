"""The eagle3_drafter asset on a real ephemeral Dagster instance: observations while training (the
UI's loss/accuracy curves), a materialization with the curve table, and the exported folder; in
this process, or (``nproc_per_node: 2``) as a local Pipes subprocess under torchrun, two CPU ranks."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest

pytest.importorskip("torch")

import dagster as dg

from eagle3_pipeline.components.eagle3.eagle3_drafter import (
    build_drafter_assets,
    checkpoint_chart,
    selection_metadata,
    start_metadata,
)
from eagle3_pipeline.config import load_config
from eagle3_pipeline.drafter.spec import drafter_paths
from eagle3_pipeline.testing.tiny_store import random_store, random_target
from eagle3_pipeline_tests.dagster_runs import pipeline_resources
from eagle3_pipeline_tests.pipeline_files import load_pipeline, write_pipeline

SAMPLES = Path(__file__).resolve().parents[2] / "eagle3_pipeline" / "samples"
# A target the tests never load (the drafter trains on a store of random tensors) and the shipped chat samples.
CHAT_SAMPLES = {
    "name": "t",
    "target": {"model": "m", "tokenizer": None},
    "datasets": [{"id": "B1", "source": str(SAMPLES / "chat.jsonl")}],
}


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.slow
def test_materializing_the_drafter_records_curves_and_exports(tmp_path: Path, processes: int) -> None:
    target = random_target(tmp_path / "target")
    drafter = {
        "target_weights": str(target),
        "ttt_steps": 2,
        "epochs": 1,
        "batch_tokens": 96,
        "max_seq_len": 32,
        "log_every": 2,
        "checkpoint_every": 4,
        "lr": 0.003,
        "nproc_per_node": processes,
        "select": "best",
    }
    pipeline = write_pipeline(
        tmp_path, CHAT_SAMPLES, {"artifacts_root": str(tmp_path / "artifacts"), "drafter": drafter}
    )
    config = load_config(pipeline)
    paths = drafter_paths(config.artifacts_root)
    random_store(paths["store"], paths["draft_vocab"], target_dir=target, samples=30, draft_vocab_size=40)
    assets = build_drafter_assets(config)
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize(assets, instance=instance, resources=pipeline_resources(pipeline))
    assert result.success
    lines = [entry.user_message for entry in instance.all_logs(result.run_id)]
    assert any(
        m.startswith("training a new drafter") and m.endswith(f"{processes} process" + ("es" if processes > 1 else ""))
        for m in lines
    )
    assert any(
        m.startswith("running train in 2 local processes: ") and "torch.distributed.run" in m for m in lines
    ) == (processes > 1)
    observations = [e for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"]
    assert observations and "acc_1" in observations[0].asset_observation_data.asset_observation.metadata
    metadata = result.asset_materializations_for_node("eagle3_drafter")[0].metadata
    assert {"first_loss", "last_loss", "training_curve", "eval_at_checkpoints", "export_dir"} <= set(metadata)
    curve = metadata["training_curve"]
    assert isinstance(curve, dg.TableMetadataValue) and len(curve.records) == len(observations)
    assert metadata["processes"].value == processes
    # select: best: τ at the served depth of every evaluated checkpoint, as a table and a plottable series
    selected = metadata["selected"].value
    assert isinstance(selected, dict) and selected["select"] == "best" and selected["select_steps"] == 3
    by_checkpoint = metadata["tau_by_checkpoint"]
    assert isinstance(by_checkpoint, dg.TableMetadataValue)
    evals = metadata["eval_at_checkpoints"]
    assert isinstance(evals, dg.TableMetadataValue) and len(by_checkpoint.records) == len(evals.records) >= 2
    exported = [r.data["step"] for r in by_checkpoint.records if r.data["exported"] == 1.0]
    assert exported == [selected["step"]]
    series = metadata["tau_by_checkpoint_series"].value
    assert isinstance(series, dict) and series["step"] == [r.data["step"] for r in by_checkpoint.records]
    taus = series["tau@3"]
    assert isinstance(taus, list) and max(cast(list[float], taus)) == selected["tau@3"]
    assert (paths["export_dir"] / "config.json").is_file() and (paths["export_dir"] / "model.safetensors").is_file()


def test_the_drafter_depends_on_the_vocab_and_the_hidden_states(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, CHAT_SAMPLES, {"artifacts_root": str(tmp_path)}, runtime_checks=True)
    (drafter,) = build_drafter_assets(config)
    assert {k.to_user_string() for k in drafter.dependency_keys} == {"draft_vocab", "hidden_states"}
    assert drafter.group_names_by_key[dg.AssetKey("eagle3_drafter")] == "eagle3"


def test_the_checkpoint_chart_marks_the_exported_one_and_shows_the_start() -> None:
    """The τ-by-checkpoint chart (markdown, read in one materialization): bars from the lowest to the
    highest τ shown, the exported checkpoint marked, a warm start's τ first; its gain beside it."""
    rows = [{"step": 10, "tau@3": 1.5}, {"step": 20, "tau@3": 2.0}, {"step": 30, "tau@3": 1.75}]
    chart = checkpoint_chart(rows, "tau@3", 20, 1.25)
    lines = chart.splitlines()
    assert lines[0] == "tau@3 by checkpoint: `▁▃█▆` (1.250 – 2.000)"
    table = lines[lines.index("| step | tau@3 | |") + 2 :]
    assert [line.split(" | ")[0] for line in table] == ["| start", "| 10", "| 20", "| 30"]
    bars = [line.split("`")[1] for line in table]
    assert [bar.count("█") for bar in bars] == [1, 9, 24, 16] and all(len(bar) == 24 for bar in bars)
    assert [line.endswith("◀ exported |") for line in table] == [False, False, True, False]
    assert checkpoint_chart(rows[:1], "tau@3", None, None).endswith("| 10 | 1.500 | `" + "█" * 24 + "` |")

    result = {"selected": {"select_steps": 3, "step": 20, "tau@3": 2.0}, "evals": rows,
              "start": {"from": "/s", "tau@3": 1.25, "accept_0": 0.4}}  # fmt: skip
    shown = {**selection_metadata(result), **start_metadata(result)}
    assert isinstance(shown["tau_by_checkpoint_chart"], dg.MarkdownMetadataValue)
    assert "| start | 1.250 |" in shown["tau_by_checkpoint_chart"].value
    assert shown["start_tau@3"] == 1.25 and shown["tau@3_gain_over_start"] == 0.75
    assert start_metadata({**result, "start": None}) == {}
