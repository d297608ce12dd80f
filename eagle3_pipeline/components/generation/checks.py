"""Asset checks: each reads what an asset wrote and calls one domain function.

Each check is a module function named after it; :func:`build_response_checks` wires the ones on
``responses`` (partitioned, blocking): write the next one here, then add it with its description
there and its name to :data:`RESPONSE_CHECKS`. The assets factory includes them all, so ``dagster dev``
and the CLI run them after each materialization. The blocking check on ``training_data`` (its template
mismatch rate) is wired by :func:`build_training_data_checks`.
"""

import warnings
from collections.abc import Callable
from typing import Any

import dagster as dg

from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation import table_budget_state
from eagle3_pipeline.generation.quality import account_for_prompts, examples, inspect_responses, model_consistency
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames
from eagle3_pipeline.training_data import read_manifest

# The checks on `responses`, all blocking; training_data refuses to run unless each passes on every dataset.
RESPONSE_CHECKS = ("empty_answers", "prompts_accounted", "single_model", "token_budget", "truncation_rate")
# A blocking check's judgement of one dataset's responses: (passed, description, metadata).
Verdict = Callable[[PipelineConfig, ArtifactLayout, str], tuple[bool, str, dict[str, Any]]]


def response_check_keys(names: PipelineNames = DEFAULT_NAMES) -> list[dg.AssetCheckKey]:
    """The keys of the checks on `responses` (:func:`build_response_checks` defines one per name)."""
    return [names.check("responses", name) for name in RESPONSE_CHECKS]


def token_budget(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    config = StepResources.of_asset(context).config()
    dataset = config.dataset(context.partition_key)
    path = ArtifactLayout(config.artifacts_root).responses(dataset.id)
    if not path.exists():
        return dg.AssetCheckResult(passed=False, description=f"{path} does not exist; materialize responses first")
    state = table_budget_state(path, dataset.token_budget, config.generation)
    if state.budget is None:
        verdict = f"no token_budget; {state.tokens} tokens counted"
    elif state.within_bound:
        verdict = (
            f"{state.tokens} of {state.budget} tokens; overshoot {state.overshoot} ≤ bound {state.overshoot_bound}"
        )
    else:
        verdict = (
            f"{state.tokens} tokens exceed the budget {state.budget} by {state.overshoot}, more than the "
            f"{state.overshoot_bound} the requests in flight can explain (a rerun of responses holds back "
            "the answers over it)"
        )
    return dg.AssetCheckResult(
        passed=state.within_bound,
        severity=dg.AssetCheckSeverity.ERROR,
        description=verdict,
        metadata=state.as_metadata(),
    )


def _judge(context: dg.AssetCheckExecutionContext, verdict: Verdict) -> dg.AssetCheckResult:
    """A check on one dataset's responses: ``verdict`` over them, or a failure when they do not exist."""
    config = StepResources.of_asset(context).config()
    layout = ArtifactLayout(config.artifacts_root)
    path = layout.responses(context.partition_key)
    if not path.exists():
        return dg.AssetCheckResult(passed=False, description=f"{path} does not exist; materialize responses first")
    passed, detail, metadata = verdict(config, layout, context.partition_key)
    return dg.AssetCheckResult(passed=passed, description=detail, metadata=metadata)


def _accounted(config: PipelineConfig, layout: ArtifactLayout, dataset_id: str) -> tuple[bool, str, dict[str, Any]]:
    a = account_for_prompts(layout, dataset_id, config.dataset(dataset_id).token_budget, config.generation)
    metadata = {
        "prompts": a.prompts,
        "answered": a.answered,
        "failed": len(a.failed),
        "over_length": a.over_length,
        "held_back_by_budget": a.held_back,
        "orphans": len(a.orphans),
        "unaccounted": len(a.unaccounted),
    }
    return a.consistent, a.verdict(), metadata


def _single_model(config: PipelineConfig, layout: ArtifactLayout, dataset_id: str) -> tuple[bool, str, dict[str, Any]]:
    m = model_consistency(layout, dataset_id)
    return m.single, m.verdict(), {"models": list(m.table_models)}


def _empty_answers(config: PipelineConfig, layout: ArtifactLayout, dataset_id: str) -> tuple[bool, str, dict[str, Any]]:
    max_empty = config.generation.max_empty_rate
    a = account_for_prompts(layout, dataset_id, config.dataset(dataset_id).token_budget, config.generation)
    detail = (
        f"{len(a.empty_failed)} of {a.sent} prompts sent are left with an empty answer "
        f"({a.empty_rate:.1%}; limit {max_empty:.1%})"
    )
    if a.empty_failed:
        detail += (
            f", e.g. {examples(a.empty_failed)}; a rerun retries them (a reasoning model may need a larger max_tokens)"
        )
    return (
        a.empty_rate <= max_empty,
        detail,
        {"empty_failed": len(a.empty_failed), "empty_rate": round(a.empty_rate, 4)},
    )


def _truncation(config: PipelineConfig, layout: ArtifactLayout, dataset_id: str) -> tuple[bool, str, dict[str, Any]]:
    max_rate = config.health.max_truncation_rate
    q = inspect_responses(layout.responses(dataset_id))
    detail = f"{q.truncated} of {q.rows} truncated ({q.truncation_rate:.0%}; limit {max_rate:.0%})"
    return q.truncation_rate <= max_rate, detail, {"rows": q.rows}


def prompts_accounted(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    return _judge(context, _accounted)


def single_model(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    return _judge(context, _single_model)


def empty_answers(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    return _judge(context, _empty_answers)


def truncation_rate(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    return _judge(context, _truncation)


def build_response_checks(
    loaded: PipelineConfig, responses: dg.AssetsDefinition, names: PipelineNames = DEFAULT_NAMES
) -> list[dg.AssetChecksDefinition]:
    """`loaded` (the file as loaded) words the descriptions; each check reads the file afresh when it runs.
    The checks are partitioned like `responses` (one verdict per dataset), a Preview feature of Dagster:
    its PreviewWarning is expected here, so it is silenced while these checks are defined only."""
    descriptions = {
        token_budget: "The dataset's counted tokens are within its token_budget plus what the requests in "
        "flight at the stop can add (in-flight slots × max_tokens per turn, + prompt tokens when they count).",
        prompts_accounted: "Read against the prompts, the checkpoint, the errors file and the accounting: every "
        "prompt is answered, failed for good, over length or skipped by the reached budget; every row is in the "
        "checkpoint; no row belongs to a prompt that is not in the prompts table.",
        single_model: "All answers come from one model, as the server named it (several endpoints of it are fine).",
        empty_answers: f"At most {loaded.generation.max_empty_rate:.1%} of the prompts sent are left with an empty "
        "answer (generation.max_empty_rate); "
        "empty answers are retried and never stored, so a rerun can repair this.",
        truncation_rate: f"At most {loaded.health.max_truncation_rate:.0%} of responses stopped at max_tokens "
        "(finish_reason 'length').",
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*partitions_def on an AssetCheckSpec.*", category=dg.PreviewWarning)
        checks = [
            dg.asset_check(
                asset=responses,
                partitions_def=responses.partitions_def,
                blocking=True,
                required_resource_keys={names.pipeline},
                description=description,
            )(check)
            for check, description in descriptions.items()
        ]
    assert sorted(spec.name for c in checks for spec in c.check_specs) == list(RESPONSE_CHECKS)
    return checks


# --- Checks on training_data -------------------------------------------------------------------


def template_mismatch_rate(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    config = StepResources.of_asset(context).config()
    ceiling = config.training_data.max_template_mismatch_rate
    try:
        manifest = read_manifest(ArtifactLayout(config.artifacts_root).training_data)
    except FileNotFoundError as exc:
        return dg.AssetCheckResult(passed=False, description=str(exc))
    rate = float(manifest["template_mismatch_rate"])
    examples = manifest.get("template_mismatch_examples") or []
    detail = f"{manifest['template_mismatch']} template mismatches ({rate:.2%}; limit {ceiling:.2%})"
    if examples:
        detail += f", e.g. {examples[0]}"
    return dg.AssetCheckResult(
        passed=rate <= ceiling,
        description=detail,
        metadata={
            "template_mismatch": manifest["template_mismatch"],
            "template_mismatch_rate": rate,
            "examples": examples,
        },
    )


def build_training_data_checks(
    loaded: PipelineConfig, training_data: dg.AssetsDefinition, names: PipelineNames = DEFAULT_NAMES
) -> list[dg.AssetChecksDefinition]:
    check = dg.asset_check(
        asset=training_data,
        blocking=True,
        required_resource_keys={names.pipeline},
        description=f"At most {loaded.training_data.max_template_mismatch_rate:.2%} of the conversations have "
        "generated turns the target's chat template "
        "cannot render faithfully (training_data.max_template_mismatch_rate); they are left out of the shards.",
    )(template_mismatch_rate)
    return [check]
