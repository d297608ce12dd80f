"""EAGLE-3 phase A as assets (group ``eagle3``): the draft vocabulary and the hidden states.

Asset → domain function:
  draft_vocab   → eagle3_pipeline.draft_vocab.build_draft_vocab         (check: coverage floor)
  hidden_states → eagle3_pipeline.hidden_states.extract:run, the heavy phase `extract`
                  (checks, from the phase's own metadata: spot_check, bytes_per_token)
"""

from collections.abc import Mapping

import dagster as dg

from eagle3_pipeline import compute
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.draft_vocab import build_draft_vocab
from eagle3_pipeline.hidden_states.capture import TargetLoadError
from eagle3_pipeline.hidden_states.extract import ExtractionError, spec_from_config, target_weights
from eagle3_pipeline.hidden_states.inputs import TrainingDataError
from eagle3_pipeline.hidden_states.store import StoreError
from eagle3_pipeline.layout import ArtifactLayout

GROUP = "eagle3"
BYTES_PER_TOKEN_TOLERANCE = 0.05
PHASE_ERRORS = (ExtractionError, StoreError, TrainingDataError, TargetLoadError)


class DagsterReporter:
    """A phase's `Reporter` inside an asset: log lines to the run, progress as observations."""

    def __init__(self, context: dg.AssetExecutionContext) -> None:
        self.context = context

    def log(self, message: str) -> None:
        self.context.log.info(message)

    def progress(self, metrics: Mapping[str, float | int | str]) -> None:
        self.context.log_event(dg.AssetObservation(asset_key=self.context.asset_key, metadata=dict(metrics)))


def build_eagle3_assets(config: PipelineConfig) -> list[dg.AssetsDefinition | dg.AssetChecksDefinition]:
    layout = ArtifactLayout(config.artifacts_root)
    training_data = dg.AssetKey("training_data")

    @dg.asset(
        group_name=GROUP,
        kinds={"safetensors"},
        deps=[training_data],
        description="The draft vocabulary: the draft_vocab.size most frequent target ids among the masked tokens "
        "of the train split, sorted, as d2t (draft id → offset to target id) and t2d (bool over the target vocab).",
    )
    def draft_vocab(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        settings = config.draft_vocab
        try:
            result = build_draft_vocab(layout.training_data, layout.draft_vocab, settings.size, settings.target_vocab_size)
        except (TrainingDataError, ValueError) as exc:
            raise dg.Failure(description=str(exc)) from None
        context.log.info(
            f"draft_vocab: {result.draft_vocab_size} of {result.target_vocab_size} ids cover {result.coverage:.2%} of "
            f"{result.train_masked_tokens} masked train tokens ({result.eval_coverage:.2%} of eval)"
        )
        return dg.MaterializeResult(metadata={**result.manifest(), "path": dg.MetadataValue.path(str(layout.draft_vocab))})

    @dg.asset_check(
        asset=draft_vocab,
        name="coverage",
        blocking=True,
        description=f"The draft vocabulary covers at least draft_vocab.min_coverage ({config.draft_vocab.min_coverage:.0%}) "
        "of the masked train tokens.",
    )
    def draft_vocab_coverage(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        from eagle3_pipeline.hidden_states.store import load_draft_vocab

        try:
            _, _, manifest = load_draft_vocab(layout.draft_vocab)
        except StoreError as exc:
            return dg.AssetCheckResult(passed=False, description=str(exc))
        floor = config.draft_vocab.min_coverage
        return dg.AssetCheckResult(
            passed=manifest["coverage"] >= floor,
            description=f"coverage {manifest['coverage']:.2%} of masked train tokens (floor {floor:.0%})",
            metadata={"coverage": manifest["coverage"], "eval_coverage": manifest["eval_coverage"], "floor": floor},
        )

    @dg.asset(
        group_name=GROUP,
        kinds={"safetensors", "parquet"},
        deps=[training_data],
        pool="gpu",
        check_specs=[
            dg.AssetCheckSpec("spot_check", asset="hidden_states", blocking=True,
                              description="Sampled sequences re-computed alone (batch size 1, no padding, transformers' "
                              "output_hidden_states) match the stored states within hidden_states.spot_check_tolerance."),
            dg.AssetCheckSpec("bytes_per_token", asset="hidden_states",
                              description="Bytes on disk per token within 5 % of (3 aux + teacher) × hidden × 2 + 5."),
        ],
        description="The target's hidden states for every train and eval sample: 3 aux layers (output-of-layer ids) "
        "and the teacher (final hidden state after the final norm), bf16 safetensors shards + Parquet index.",
    )
    def hidden_states(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        spec = spec_from_config(config, str(layout.training_data), str(layout.hidden_states), target_weights(config))
        try:
            meta = compute.run_local("extract", spec, DagsterReporter(context))
        except PHASE_ERRORS as exc:
            raise dg.Failure(description=str(exc)) from None
        ratio = meta["bytes_per_token_ratio"]
        checks = [
            dg.AssetCheckResult(
                check_name="spot_check",
                passed=bool(meta["spot_check_passed"]),
                description=f"{meta['spot_check_samples']} samples, max relative error {meta['spot_check_max_rel_error']:.2e} "
                f"(tolerance {meta['spot_check_tolerance']}; worst {meta['spot_check_worst_sample'] or '-'})",
            ),
            dg.AssetCheckResult(
                check_name="bytes_per_token",
                passed=abs(ratio - 1) <= BYTES_PER_TOKEN_TOLERANCE,
                description=f"{meta['bytes_per_token']} bytes/token, formula {meta['bytes_per_token_formula']} (ratio {ratio})",
            ),
        ]
        metadata = {**meta, "store": dg.MetadataValue.path(meta["store"]), "aux_layer_ids": str(meta["aux_layer_ids"])}
        return dg.MaterializeResult(metadata=metadata, check_results=checks)

    return [draft_vocab, draft_vocab_coverage, hidden_states]
