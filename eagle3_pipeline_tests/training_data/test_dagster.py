"""The `training_data` asset and its blocking template-mismatch check on a real Dagster instance,
with the embedded model's real tokenizer (whose template renders no tool calls)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.testing.c1_records import generated, message, response_row, write_responses
from eagle3_pipeline_tests.pipeline_files import load_pipeline

pytestmark = pytest.mark.local_model


def pipeline(folder: Path, model: Path, ceiling: float) -> PipelineConfig:
    (folder / "p.jsonl").write_text("")
    sections = {
        "name": "td",
        "target": {"model": "m", "tokenizer": str(model)},
        "inference": {"kind": "endpoints", "endpoints": [{"base_url": "http://127.0.0.1:9/v1"}]},
        "training_data": {"eval_fraction": 0.0, "max_template_mismatch_rate": ceiling},
        "datasets": [{"id": "B1", "source": "p.jsonl"}],
    }
    config = load_pipeline(folder, sections, runtime_checks=True)
    call = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]
    rows = [
        response_row(f"q{i}", "B1", [message("user", f"Question {i}?"), generated(f"Answer {i}.")]) for i in range(3)
    ]
    rows.append(
        response_row("tool", "B1", [message("user", "Look it up"), generated(None, "tool_calls", tool_calls=call)])
    )
    path = ArtifactLayout(config.artifacts_root).responses("B1")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_responses(path, rows)
    return config


def materialize(config: PipelineConfig) -> dg.ExecuteInJobResult:
    defs = build_definitions(config)
    assets: Any = list(defs.assets or [])
    return dg.materialize(
        assets,
        selection=["training_data"],
        instance=dg.DagsterInstance.ephemeral(),
        resources=defs.resources,
        raise_on_error=False,
    )


def mismatch_check(result: dg.ExecuteInJobResult) -> dg.AssetCheckEvaluation:
    [evaluation] = [e for e in result.get_asset_check_evaluations() if e.check_name == "template_mismatch_rate"]
    return cast(dg.AssetCheckEvaluation, evaluation)


def test_mismatch_rate_above_the_ceiling_fails_the_blocking_check(tmp_path: Path, local_model: Path) -> None:
    result = materialize(pipeline(tmp_path, local_model, ceiling=0.1))
    check = mismatch_check(result)
    assert not check.passed
    assert check.description is not None and "1 template mismatches (25.00%; limit 10.00%)" in check.description
    assert "B1/tool: message 1: the template renders nothing" in check.description


def test_mismatch_rate_within_the_ceiling_passes_and_metadata_is_per_dataset(tmp_path: Path, local_model: Path) -> None:
    result = materialize(pipeline(tmp_path, local_model, ceiling=0.5))
    assert result.success and mismatch_check(result).passed
    [materialization] = result.asset_materializations_for_node("training_data")
    metadata = materialization.metadata
    assert metadata["rows"].value == 3 and metadata["template_mismatch_rate"].value == 0.25
    table = cast(dg.TableMetadataValue, metadata["per_dataset"])
    [record] = table.records
    masked = record.data["masked_tokens"]
    assert record.data["dataset"] == "B1" and record.data["rows"] == 3 and isinstance(masked, int) and masked > 0
    assert record.data["template_mismatch"] == 1
    assert len(str(metadata["version"].value)) == 16
