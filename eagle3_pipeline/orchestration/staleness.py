"""Which `responses` partitions need (re)generation: missing ones and stale ones.

Staleness is read from Dagster's own records, in one place: a partition is stale when its
`prompts` partition was materialized after it (new prompts were collected), or when it was
materialized by another code version of `responses` than the one now defined (the code version is
the generation fingerprint's digest). The files have the last word too: a partition whose table is
gone or whose checkpoint was written under other generation settings is stale
(:func:`eagle3_pipeline.generation.fingerprint.partition_is_stale`).
"""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation.fingerprint import configured_fingerprint, partition_is_stale
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames

CODE_VERSION_TAG = "dagster/code_version"


def _latest(instance: dg.DagsterInstance, key: dg.AssetKey, partitions: Sequence[str]) -> dict[str, dg.EventLogRecord]:
    latest: dict[str, dg.EventLogRecord] = {}
    for partition in partitions:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition]), limit=1
        ).records
        if records:
            latest[partition] = records[0]
    return latest


def stale_partitions(
    instance: dg.DagsterInstance,
    partitions: Sequence[str],
    code_version: str | None = None,
    names: PipelineNames = DEFAULT_NAMES,
) -> dict[str, str]:
    """partition → why it is stale, for materialized partitions of the pipeline of `names` that are out of date."""
    responses = _latest(instance, names.key("responses"), partitions)
    prompts = _latest(instance, names.key("prompts"), list(responses))
    stale: dict[str, str] = {}
    for partition, record in responses.items():
        upstream = prompts.get(partition)
        if upstream is not None and upstream.storage_id > record.storage_id:
            stale[partition] = "its prompts were materialized after it"
            continue
        materialization = record.asset_materialization
        recorded = materialization.tags.get(CODE_VERSION_TAG) if materialization and materialization.tags else None
        if code_version is not None and recorded is not None and recorded != code_version:
            stale[partition] = f"made by code version {recorded}, now {code_version}"
    return stale


def partitions_to_generate(
    instance: dg.DagsterInstance, config: PipelineConfig, names: PipelineNames = DEFAULT_NAMES
) -> dict[str, str]:
    """partition → why it needs a run (missing or stale), in the pipeline file's dataset order; the
    records read are those of the pipeline of `names`."""
    partitions = config.dataset_ids
    done = instance.get_materialized_partitions(names.key("responses"))
    configured = configured_fingerprint(config.generation, config.target, config.inference)
    stale = stale_partitions(instance, [p for p in partitions if p in done], configured.digest, names)
    wanted = {}
    for partition in partitions:
        if partition not in done:
            wanted[partition] = "missing"
        elif partition in stale:
            wanted[partition] = f"stale: {stale[partition]}"
        else:
            on_disk = partition_is_stale(config.artifacts_root, configured, partition)
            if on_disk is not None:
                wanted[partition] = on_disk
    return wanted
