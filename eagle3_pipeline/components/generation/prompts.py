"""`prompts`: the sampled prompts of one dataset (a partition), by
eagle3_pipeline.generation.prompts.write_prompts, with a preview table (:func:`preview`, which `responses`
shows too)."""

from collections.abc import Sequence
from typing import Any

import dagster as dg

from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.config import ConfigError, check_sources
from eagle3_pipeline.generation.prompts import write_prompts
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.orchestration.names import PipelineNames

PREVIEW_ROWS = 5


def preview(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> dg.MetadataValue:
    """The first rows of `rows` as a Markdown table of `columns`, each cell cut at 80 characters."""

    def cell(value: Any) -> str:
        text = str(value).replace("\n", " ").replace("|", "\\|")
        return text if len(text) <= 80 else text[:77] + "..."

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows[:PREVIEW_ROWS]]
    return dg.MetadataValue.md("\n".join(lines))


def prompts(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    resources = StepResources.of_asset(context)
    config = resources.config()
    layout = ArtifactLayout(config.artifacts_root)
    dataset = config.dataset(context.partition_key)
    try:
        check_sources(config, only=[dataset])
    except ConfigError as exc:
        raise dg.Failure(description=str(exc)) from None
    path = layout.prompts(dataset.id)
    phase = write_prompts(dataset, config.prompts, config.seed, path)
    stats = phase.stats
    context.log.info(f"{dataset.id}: {stats.kept} prompts from {stats.read} records ({stats.malformed} malformed)")
    resources.listener.result("prompts", dataset.id, phase.result)
    return dg.MaterializeResult(
        metadata={
            **phase.result.as_metadata(),
            "path": dg.MetadataValue.path(str(path)),
            "preview": preview(
                [
                    {"id": r.id, "class": r.length_class, "last user turn": r.messages[-1]["content"]}
                    for r in phase.records
                ],
                ["id", "class", "last user turn"],
            ),
        }
    )


def build_prompts(
    names: PipelineNames, partitions: dg.PartitionsDefinition, backfill: dg.AutomationCondition | None
) -> dg.AssetsDefinition:
    """The asset, one partition per dataset, launched by the scheduled backfill's condition."""
    return dg.asset(
        key_prefix=names.key_prefix,
        partitions_def=partitions,
        group_name=names.name("data"),
        kinds={"parquet"},
        required_resource_keys={names.pipeline, names.phase_listener},
        automation_condition=backfill,
        description="Normalized prompts of one source dataset: stable content-hash ids, messages, "
        "tools, length class, estimated prompt tokens.",
    )(prompts)
