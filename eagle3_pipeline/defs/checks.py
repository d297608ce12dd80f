"""Asset checks: each reads what an asset wrote and calls one domain function.

Checks on ``responses`` live in :func:`build_response_checks`: define the next one there (one
partitioned ``@dg.asset_check`` per property of a dataset's responses) and add it to the list it
returns; the assets factory includes them all, so ``dagster dev`` and the CLI run them after each
materialization. The blocking check on ``training_data`` (its template mismatch rate) lives in
:func:`build_training_data_checks`.
"""

from collections.abc import Callable

import dagster as dg

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.dataprep import read_manifest
from eagle3_pipeline.generation import table_budget_state
from eagle3_pipeline.generation.quality import EXAMPLES, ResponseTableQuality, inspect_responses
from eagle3_pipeline.layout import ArtifactLayout


def build_response_checks(config: PipelineConfig, responses: dg.AssetsDefinition) -> list[dg.AssetChecksDefinition]:
    layout = ArtifactLayout(config.artifacts_root)

    @dg.asset_check(
        asset=responses,
        partitions_def=responses.partitions_def,
        description="The dataset's counted tokens are within its token_budget plus what the requests in "
        "flight at the stop can add (in-flight slots × max_tokens per turn, + prompt tokens when they count).",
    )
    def token_budget(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        dataset = config.dataset(context.partition_key)
        path = layout.responses(dataset.id)
        if not path.exists():
            return dg.AssetCheckResult(passed=False, description=f"{path} does not exist; materialize responses first")
        state = table_budget_state(path, dataset.token_budget, config.generation)
        if state.budget is None:
            verdict = f"no token_budget; {state.tokens} tokens counted"
        elif state.within_bound:
            verdict = f"{state.tokens} of {state.budget} tokens; overshoot {state.overshoot} ≤ bound {state.overshoot_bound}"
        else:
            verdict = (
                f"{state.tokens} tokens exceed the budget {state.budget} by {state.overshoot}, more than the "
                f"{state.overshoot_bound} the requests in flight can explain (was the budget lowered after generating?)"
            )
        return dg.AssetCheckResult(
            passed=state.within_bound, severity=dg.AssetCheckSeverity.ERROR, description=verdict, metadata=state.as_metadata()
        )

    def blocking_check(name: str, description: str, verdict: Callable[[ResponseTableQuality], tuple[bool, str]]) -> dg.AssetChecksDefinition:
        @dg.asset_check(
            asset=responses, name=name, partitions_def=responses.partitions_def, blocking=True, description=description
        )
        def check(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
            path = layout.responses(context.partition_key)
            if not path.exists():
                return dg.AssetCheckResult(passed=False, description=f"{path} does not exist; materialize responses first")
            quality = inspect_responses(path)
            passed, detail = verdict(quality)
            return dg.AssetCheckResult(passed=passed, description=detail, metadata={"rows": quality.rows})

        return check

    max_rate = config.health.max_truncation_rate
    quality_checks = [
        blocking_check(
            "schema",
            "The table has every column of the responses schema, with the right types.",
            lambda q: (not q.schema_problems, "; ".join(q.schema_problems) or "all columns present with their types"),
        ),
        blocking_check(
            "unique_ids",
            "No prompt id appears twice.",
            lambda q: (not q.duplicate_ids, f"{len(q.duplicate_ids)} duplicated ids, e.g. {', '.join(q.duplicate_ids[:EXAMPLES])}" if q.duplicate_ids else f"{q.rows} distinct ids"),
        ),
        blocking_check(
            "no_empty_responses",
            "Every response has text.",
            lambda q: (not q.empty_ids, f"{len(q.empty_ids)} empty responses, e.g. {', '.join(q.empty_ids[:EXAMPLES])}" if q.empty_ids else "no empty response"),
        ),
        blocking_check(
            "truncation_rate",
            f"At most {max_rate:.0%} of responses stopped at max_tokens (finish_reason 'length').",
            lambda q: (q.truncation_rate <= max_rate, f"{q.truncated} of {q.rows} truncated ({q.truncation_rate:.0%}; limit {max_rate:.0%})"),
        ),
    ]
    return [token_budget, *quality_checks]


# --- Checks on training_data -------------------------------------------------------------------


def build_training_data_checks(config: PipelineConfig, training_data: dg.AssetsDefinition) -> list[dg.AssetChecksDefinition]:
    layout = ArtifactLayout(config.artifacts_root)
    ceiling = config.training_data.max_template_mismatch_rate

    @dg.asset_check(
        asset=training_data,
        blocking=True,
        description=f"At most {ceiling:.2%} of the conversations have generated turns the target's chat template "
        "cannot render faithfully (training_data.max_template_mismatch_rate); they are left out of the shards.",
    )
    def template_mismatch_rate() -> dg.AssetCheckResult:
        try:
            manifest = read_manifest(layout.training_data)
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
            metadata={"template_mismatch": manifest["template_mismatch"], "template_mismatch_rate": rate, "examples": examples},
        )

    return [template_mismatch_rate]
