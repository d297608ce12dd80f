"""The `drafter_eval` asset and its blocking check.

Asset → domain function: drafter_eval → eagle3_pipeline.drafter.evaluate.phase:run (the ``evaluate`` phase), with
the GPUs of a managed server on its machine handed over (eagle3_pipeline.components.managed:hand_over).
Check `tau_regression` → eagle3_pipeline.drafter.evaluate.phase.tau_regressions, over this and the previous
materialization as the instance recorded them.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dagster as dg

from eagle3_pipeline.components.fit import fitted
from eagle3_pipeline.components.managed import hand_over
from eagle3_pipeline.components.policy import step_policy
from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.drafter.evaluate.phase import held_out_spec, spec_settings
from eagle3_pipeline.drafter.evaluate.results import WARNING, tau_regressions
from eagle3_pipeline.drafter.evaluate.scaling import data_scaling_markdown
from eagle3_pipeline.drafter.spec import drafter_paths, target_weights
from eagle3_pipeline.health.alerts import Alerter, tau_checked
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.orchestration.gating import require_passing_checks
from eagle3_pipeline.orchestration.heavy_phase import run_heavy_phase
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames
from eagle3_pipeline.results import DrafterEvalResult

# The key of drafter_eval in the pipeline without a key_prefix.
DRAFTER_EVAL = DEFAULT_NAMES.key("drafter_eval")
UPSTREAM = ("eagle3_drafter", "hidden_states", "draft_vocab")


def input_checks(names: PipelineNames) -> list[dg.AssetCheckKey]:
    """The blocking checks of what eagle3_drafter and drafter_eval read, honoured across runs
    (orchestration/gating.py)."""
    return [names.check("hidden_states", "spot_check"), names.check("draft_vocab", "coverage")]


def evaluate_spec(config: PipelineConfig, root: Path | None = None) -> dict[str, Any]:
    """JSON-able spec for ``evaluate:run``; ``root`` is the artifacts root where the phase runs. The
    held-out ids come from the local training_data manifest (they travel in the spec)."""
    paths = drafter_paths(root or config.artifacts_root)
    return {
        "store": str(paths["store"]),
        "draft_vocab": str(paths["draft_vocab"]),
        "drafter": str(paths["export_dir"]),
        "target_weights": target_weights(config.drafter, config.compute),
        **spec_settings(config.drafter_eval, config.drafter),
        **held_out_spec(ArtifactLayout(config.artifacts_root).training_data),
        "training_data": str(ArtifactLayout(root or config.artifacts_root).training_data),
    }


def materialization_metadata(result: Mapping[str, Any]) -> dict[str, Any]:
    """The τ table first (markdown), then the agreement warning, then the rest; numbers stay numbers
    (the UI plots each key across materializations)."""
    first = [key for key in ("table", WARNING) if key in result]
    ordered = {key: result[key] for key in first} | {key: value for key, value in result.items() if key not in first}
    return {key: dg.MetadataValue.md(value) if key == "table" else value for key, value in ordered.items()}


def _numbers(metadata: Mapping[str, dg.MetadataValue]) -> dict[str, float]:
    return {
        key: float(value.value)
        for key, value in metadata.items()
        if isinstance(value.value, (int, float)) and not isinstance(value.value, bool)
    }


def drafter_eval(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    resources = StepResources.of_asset(context)
    names = resources.names
    config = fitted(context, resources.config(), "drafter_eval")
    require_passing_checks(context.instance, input_checks(names))
    with hand_over(context, config, names, "drafter_eval"):
        result = DrafterEvalResult.from_metadata(
            run_heavy_phase(
                context,
                config.compute,
                artifacts_root=config.artifacts_root,
                phase="evaluate",
                spec=evaluate_spec(config),
            )
        )
    resources.listener.result("drafter_eval", None, result)
    for line in str(result.extra.get(WARNING, "")).splitlines():
        context.log.warning(line)
    # data_scaling: what more data of each dataset buys
    table = data_scaling_markdown(config.artifacts_root, config.inference, config.target.model, config.dataset_ids)
    scaling = {"data_scaling": dg.MetadataValue.md(table)}
    return dg.MaterializeResult(metadata=materialization_metadata({**result.as_metadata(), **scaling}))


def tau_regression(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    resources = StepResources.of_asset(context)
    names = resources.names
    config = resources.config()
    settings = config.drafter_eval
    records = context.instance.fetch_materializations(names.key("drafter_eval"), limit=2).records
    if not records or records[0].asset_materialization is None:
        return dg.AssetCheckResult(passed=False, description="drafter_eval has no materialization to check")
    current = _numbers(records[0].asset_materialization.metadata)
    previous_record = records[1].asset_materialization if len(records) > 1 else None
    previous = _numbers(previous_record.metadata) if previous_record is not None else None
    problems = tau_regressions(current, previous, settings.min_tau, settings.max_tau_drop)
    taus = {key: value for key, value in current.items() if key.startswith("tau@")}
    if not taus:
        problems.append("no drafter τ in the materialization (was the drafter missing?)")
    verdict = (
        "; ".join(problems)
        if problems
        else (
            f"{len(taus)} τ figures ≥ {settings.min_tau:g}"
            + (
                f" and within {settings.max_tau_drop:g} of the previous run"
                if previous is not None
                else " (no previous run)"
            )
        )
    )
    tau_checked(Alerter.for_pipeline(config, context.log.warning), not problems, verdict)
    return dg.AssetCheckResult(
        passed=not problems,
        severity=dg.AssetCheckSeverity.ERROR,
        description=verdict,
        metadata={"problems": len(problems), "compared_with_previous": previous is not None},
    )


def build_drafter_eval(
    loaded: PipelineConfig, names: PipelineNames = DEFAULT_NAMES
) -> list[dg.AssetsDefinition | dg.AssetChecksDefinition]:
    """`loaded` (the file at load) words the descriptions; bodies read the pipeline's settings
    resource (key `names.pipeline`)."""
    described = loaded.drafter_eval

    drafter_eval_asset = dg.asset(
        key_prefix=names.key_prefix,
        group_name=names.name("eagle3"),
        kinds={"pytorch"},
        deps=[names.key(asset) for asset in UPSTREAM],
        required_resource_keys={names.pipeline, names.phase_listener},
        description="Acceptance length τ of the trained drafter on the eval split, per dataset and draft depth "
        f"K ∈ {list(described.steps)}, walked the way a greedy chain-drafting server accepts tokens, "
        "against the stored "
        "tokens and against the target's argmax; the share of positions where the two agree (a warning below "
        f"drafter_eval.min_data_agreement, {described.min_data_agreement:g}); τ on training_data's fixed held-out ids "
        "apart; per-depth conditional acceptance; a bigram drafter over the same draft vocabulary as the baseline; "
        "an estimated speedup τ / (1 + K·c).",
        **step_policy(loaded, "drafter_eval"),
    )(drafter_eval)

    tau_regression_check = dg.asset_check(
        asset=drafter_eval_asset,
        blocking=True,
        required_resource_keys={names.pipeline},
        description=f"Every τ@K (each dataset and all) is at least drafter_eval.min_tau ({described.min_tau:g}) and "
        "at most "
        f"drafter_eval.max_tau_drop ({described.max_tau_drop:g}) below the previous materialization's.",
    )(tau_regression)

    return [drafter_eval_asset, tau_regression_check]
