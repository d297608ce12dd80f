"""The `eagle3_drafter` asset: train the EAGLE-3 drafter on the hidden states and export it.

Asset → domain function: eagle3_drafter → eagle3_pipeline.drafter.train:run (the ``train`` phase).
"""

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from eagle3_pipeline import compute
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.drafter.spec import train_spec


class DagsterReporter:
    """A phase's log lines go to the run log, its progress points become observations of the asset
    (the UI plots each numeric field across them: loss and per-step accuracy over training)."""

    def __init__(self, context: dg.AssetExecutionContext) -> None:
        self.context = context

    def log(self, message: str) -> None:
        self.context.log.info(message)

    def progress(self, metrics: Mapping[str, float | int | str]) -> None:
        self.context.log_event(dg.AssetObservation(asset_key=self.context.asset_key, metadata=dict(metrics)))


def _table(rows: Sequence[Mapping[str, Any]]) -> dg.MetadataValue:
    columns = list(rows[0]) if rows else ["step"]
    return dg.MetadataValue.table(
        records=[dg.TableRecord({c: float(row.get(c, float("nan"))) for c in columns}) for row in rows],
        schema=dg.TableSchema(columns=[dg.TableColumn(c, "float") for c in columns]),
    )


def materialization_metadata(result: Mapping[str, Any]) -> dict[str, Any]:
    last_eval = result["evals"][-1] if result["evals"] else {}
    return {
        "steps": result["steps"],
        "total_steps": result["total_steps"],
        "resumed_from_step": result["resumed_from_step"] if result["resumed_from_step"] is not None else -1,
        "first_loss": result["first_loss"],
        "last_loss": result["last_loss"],
        **{k: round(v, 4) for k, v in last_eval.items() if k != "step"},
        "wall_s": result["wall_s"],
        "device": result["device"],
        "training_curve": _table(result["curve"]),
        "eval_at_checkpoints": _table(result["evals"]),
        "export_dir": dg.MetadataValue.path(result["export_dir"]),
        "checkpoint": dg.MetadataValue.path(result["checkpoint"]),
        "drafter": dg.MetadataValue.json(result["drafter"]),
    }


def build_drafter_assets(config: PipelineConfig) -> list[dg.AssetsDefinition]:
    @dg.asset(
        group_name="eagle3",
        kinds={"pytorch", "safetensors"},
        deps=[dg.AssetKey("draft_vocab"), dg.AssetKey("hidden_states")],
        pool="gpu",
        description="The EAGLE-3 draft model trained on the target's hidden states (training-time test "
        "over drafter.ttt_steps, soft labels over the draft vocabulary), checkpointed and resumable, "
        "exported as a LlamaForCausalLMEagle3 folder that SGLang and vLLM load.",
    )
    def eagle3_drafter(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        result = compute.run_local("train", train_spec(config), DagsterReporter(context))
        return dg.MaterializeResult(metadata=materialization_metadata(result))

    return [eagle3_drafter]
