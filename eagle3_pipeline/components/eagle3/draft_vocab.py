"""`draft_vocab` (group ``eagle3``): the draft vocabulary (`d2t`, `t2d`) by
eagle3_pipeline.hidden_states.draft_vocab.build_draft_vocab, once the blocking check of `training_data`
passes, and its blocking check: the coverage floor."""

from pathlib import Path

import dagster as dg

from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.hidden_states.draft_vocab import build_draft_vocab
from eagle3_pipeline.hidden_states.extract import ExtractionError, target_weights
from eagle3_pipeline.hidden_states.store import StoreError
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.orchestration.gating import require_passing_checks
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames
from eagle3_pipeline.target.folder import dimensions, read_config
from eagle3_pipeline.training_data.reader import TrainingDataError

GROUP = "eagle3"


def training_data_checks(names: PipelineNames) -> list[dg.AssetCheckKey]:
    """The blocking checks of training_data, honoured across runs (orchestration/gating.py)."""
    return [names.check("training_data", "template_mismatch_rate")]


def _local_target_vocab_size(config: PipelineConfig) -> int | None:
    """The language model's vocab_size from the target's config.json when it is on this machine
    (a Kimi-K2.5 checkpoint's lm_head may have more rows than its tokenizer has tokens); None when
    the target folder is only on the GPU host (training_data's tokenizer length is then used)."""
    try:
        model = target_weights(config)
    except ExtractionError:
        return None
    if not Path(model, "config.json").is_file():
        return None
    return dimensions(read_config(model), str(Path(model, "config.json"))).vocab_size


def draft_vocab(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    resources = StepResources.of_asset(context)
    names = resources.names
    config = resources.config()
    layout = ArtifactLayout(config.artifacts_root)
    require_passing_checks(context.instance, training_data_checks(names))
    settings = config.draft_vocab
    try:
        target_vocab = settings.target_vocab_size or _local_target_vocab_size(config)
        result = build_draft_vocab(layout.training_data, layout.draft_vocab, settings.size, target_vocab)
    except (TrainingDataError, ValueError) as exc:
        raise dg.Failure(description=str(exc)) from None
    context.log.info(
        f"draft_vocab: {result.draft_vocab_size} of {result.target_vocab_size} ids cover {result.coverage:.2%} of "
        f"{result.train_masked_tokens} masked train tokens ({result.eval_coverage:.2%} of eval)"
    )
    resources.listener.result("draft_vocab", None, result)
    return dg.MaterializeResult(
        metadata={**result.as_metadata(), "path": dg.MetadataValue.path(str(layout.draft_vocab))}
    )


def draft_vocab_coverage(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    from eagle3_pipeline.hidden_states.store import load_draft_vocab

    resources = StepResources.of_asset(context)
    config = resources.config()
    layout = ArtifactLayout(config.artifacts_root)
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


def build_draft_vocab_assets(
    loaded: PipelineConfig, names: PipelineNames = DEFAULT_NAMES
) -> list[dg.AssetsDefinition | dg.AssetChecksDefinition]:
    """The asset and its coverage check; `loaded` (the file at load) words the check's description."""
    draft_vocab_asset = dg.asset(
        key_prefix=names.key_prefix,
        group_name=names.name(GROUP),
        kinds={"safetensors"},
        deps=[names.key("training_data")],
        required_resource_keys={names.pipeline, names.phase_listener},
        description="The draft vocabulary: the draft_vocab.size most frequent target ids among the masked tokens "
        "of the train split, sorted, as d2t (draft id → offset to target id) and t2d (bool over the target vocab).",
    )(draft_vocab)
    coverage = dg.asset_check(
        asset=draft_vocab_asset,
        name="coverage",
        blocking=True,
        required_resource_keys={names.pipeline},
        description="The draft vocabulary covers at least draft_vocab.min_coverage "
        f"({loaded.draft_vocab.min_coverage:.0%}) "
        "of the masked train tokens.",
    )(draft_vocab_coverage)
    return [draft_vocab_asset, coverage]
