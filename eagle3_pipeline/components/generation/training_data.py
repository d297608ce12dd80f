"""`training_data`: every dataset's answers chat-templated, loss-masked, shuffled and sharded, by
eagle3_pipeline.training_data.phase.make_training_data, once the blocking checks of `responses` pass."""

from typing import Any

import dagster as dg

from eagle3_pipeline.components.execution.automation import FOLLOW_UPSTREAM
from eagle3_pipeline.components.generation.checks import (
    response_check_keys,
)
from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.config import ConfigError, PipelineConfig
from eagle3_pipeline.inference.provider import tokenizer_name
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.orchestration.gating import require_passing_checks
from eagle3_pipeline.orchestration.names import PipelineNames
from eagle3_pipeline.training_data.agreement import ServerEndpoint, TokenizerDisagreement
from eagle3_pipeline.training_data.phase import make_training_data


def _per_dataset_table(per_dataset: dict[str, dict[str, Any]]) -> dg.MetadataValue:
    """Rows, tokens, masked tokens and template mismatches of each dataset in training_data."""
    columns = ["rows", "tokens", "masked_tokens", "template_mismatch", "template_mismatch_rate"]
    return dg.MetadataValue.table(
        records=[
            dg.TableRecord({"dataset": name, **{c: stats[c] for c in columns}}) for name, stats in per_dataset.items()
        ],
        schema=dg.TableSchema(
            columns=[
                dg.TableColumn("dataset", "string"),
                *(dg.TableColumn(c, "float" if c.endswith("rate") else "int") for c in columns),
            ]
        ),
    )


def _serving_endpoints(config: PipelineConfig) -> list[ServerEndpoint]:
    """The configured endpoints whose key (if any) is set in this process: the ones the tokenizer
    agreement can ask. The embedded server is not running when training_data runs."""
    if config.inference.kind != "endpoints":
        return []
    found = []
    for entry in config.inference.all_endpoints:
        try:
            key = config.api_key(entry)
        except ConfigError:
            continue
        found.append(ServerEndpoint(entry.base_url, entry.model or config.target.model, key))
    return found


def training_data(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    resources = StepResources.of_asset(context)
    config = resources.config()
    layout = ArtifactLayout(config.artifacts_root)
    names = resources.names
    require_passing_checks(context.instance, response_check_keys(names), config.dataset_ids)
    files = [layout.responses(d) for d in config.dataset_ids]
    missing = [d for d, f in zip(config.dataset_ids, files, strict=True) if not f.exists()]
    if missing:
        raise dg.Failure(description=f"responses are not materialized for: {', '.join(missing)}")
    tokenizer = tokenizer_name(config.target, config.inference, config.source_file)
    try:
        phase = make_training_data(
            files,
            tokenizer=tokenizer,
            layout=layout,
            seed=config.seed,
            settings=config.training_data,
            target=config.target,
            generation=config.generation,
            validation=config.hidden_states.validation,
            servers=_serving_endpoints(config),
            log=context.log.info,
        )
    except TokenizerDisagreement as exc:
        raise dg.Failure(
            description=f"the target's tokenizer ({tokenizer}) and the server's disagree, so the rows would "
            f"not hold the ids the server sees: {exc}"
        ) from None
    resources.listener.result("training_data", None, phase.result)
    return dg.MaterializeResult(
        metadata={
            **phase.result.as_metadata(),
            "per_dataset": _per_dataset_table(phase.result.extra["per_dataset"]),
            "reused": phase.reused,
            "path": dg.MetadataValue.path(str(layout.training_data)),
        },
        data_version=dg.DataVersion(phase.version),
    )


def build_training_data(names: PipelineNames, responses: dg.AssetsDefinition) -> dg.AssetsDefinition:
    """The asset, after every partition of `responses`."""
    return dg.asset(
        key_prefix=names.key_prefix,
        group_name=names.name("data"),
        kinds={"parquet"},
        deps=[responses],
        required_resource_keys={names.pipeline, names.phase_listener},
        automation_condition=FOLLOW_UPSTREAM,
        description="All datasets merged and deduplicated, chat-templated with the target's tokenizer, "
        "loss-masked to generated assistant tokens, shuffled with the config seed, split train/eval by "
        "id hash, sharded; plus the token-frequency table over masked tokens.",
    )(training_data)
