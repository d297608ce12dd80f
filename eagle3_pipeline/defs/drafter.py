"""The `eagle3_drafter` asset: train the EAGLE-3 drafter on the hidden states and export it.

Asset → domain function: eagle3_drafter → eagle3_pipeline.drafter.train:run (the ``train`` phase),
through `run_heavy_phase` wherever `compute:` says (for `command` too: the user command replaces
only extraction). On a GPU host the draft_vocab folder is shipped, the hidden states are already
there (phase A left them under the host's artifacts root), the checkpoints and the export stay on
the host, and only the export's config.json and the run's tau_curve.json (τ against the training
tokens seen, which `drafter_eval` and `eagle3-pipeline plan` read) come back. `drafter.target_weights` is then a path on
the host.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from eagle3_pipeline.compute.remote import RemoteError
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.defs.compute import run_heavy_phase, under_root
from eagle3_pipeline.defs.gating import require_passing_checks
from eagle3_pipeline.defs.resources import pipeline_settings
from eagle3_pipeline.deploy import step_tags
from eagle3_pipeline.drafter.scaling import TAU_CURVE_FILE
from eagle3_pipeline.drafter.spec import DrafterSpecError, drafter_paths, train_spec
from eagle3_pipeline.hosts import HostError

# The blocking checks of what the drafter trains on, honoured across runs (defs/gating.py).
INPUT_CHECKS = [dg.AssetCheckKey(dg.AssetKey("hidden_states"), "spot_check"), dg.AssetCheckKey(dg.AssetKey("draft_vocab"), "coverage")]


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
        "processes": result["processes"],
        "training_curve": _table(result["curve"]),
        "eval_at_checkpoints": _table(result["evals"]),
        "tau_curve": dg.MetadataValue.json(result["tau_curve"]),
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
        required_resource_keys={"pipeline"},
        op_tags=step_tags(config, "eagle3_drafter"),
        description="The EAGLE-3 draft model trained on the target's hidden states (training-time test "
        "over drafter.ttt_steps, soft labels over the draft vocabulary), checkpointed and resumable, "
        "exported as a LlamaForCausalLMEagle3 folder that SGLang and vLLM load.",
    )
    def eagle3_drafter(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        config = pipeline_settings(context)
        require_passing_checks(context.instance, INPUT_CHECKS)
        paths = drafter_paths(config.artifacts_root)
        fetch = [p.relative_to(config.artifacts_root).as_posix() for p in (paths["export_dir"] / "config.json", paths["run_dir"] / TAU_CURVE_FILE)]
        try:
            spec = train_spec(config)
            ship = [str(paths["draft_vocab"])] + ([spec["target_weights"]] if under_root(spec["target_weights"], config.artifacts_root) else [])
            result = run_heavy_phase(context, config, "train", spec, ship=ship, fetch=fetch, processes=config.drafter.nproc_per_node)
        except (DrafterSpecError, RemoteError, HostError) as exc:
            raise dg.Failure(description=str(exc)) from None
        where = {k: result[k] for k in ("compute", "host", "remote_artifacts_root") if k in result}
        return dg.MaterializeResult(metadata={**materialization_metadata(result), **where})

    return [eagle3_drafter]
