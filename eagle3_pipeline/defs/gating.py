"""Gating across runs: a phase refuses inputs whose latest blocking checks failed.

Dagster's `blocking=True` stops downstream steps only inside the run that ran the check. A later
run (the next phase materialized by automation, by hand, or by the CLI) must look at the record:
:func:`require_passing_checks` reads the latest evaluation of every blocking check on the given
upstream asset partitions and raises one `dg.Failure` naming each refused partition and check.
A rerun that fixes the partition records a passing evaluation, which lifts the gate.

Every phase calls it first thing on its inputs, with the blocking checks of the asset it reads,
e.g. in `training_data`:

    require_passing_checks(context.instance, blocking_check_keys(response_checks), config.dataset_ids)
"""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus


def blocking_check_keys(checks: Sequence[dg.AssetChecksDefinition]) -> list[dg.AssetCheckKey]:
    """The keys of the blocking checks among `checks` (e.g. what `build_response_checks` returns)."""
    return sorted((spec.key for c in checks for spec in c.check_specs if spec.blocking), key=lambda key: key.name)


def failed_blocking_checks(
    instance: dg.DagsterInstance, check_keys: Sequence[dg.AssetCheckKey], partitions: Sequence[str | None]
) -> list[str]:
    """`asset[partition]: check (its verdict)` for every latest evaluation that failed."""
    refused = []
    completed = {AssetCheckExecutionRecordStatus.SUCCEEDED, AssetCheckExecutionRecordStatus.FAILED}
    for partition in partitions:
        for key in check_keys:
            history = instance.event_log_storage.get_asset_check_execution_history(
                key, limit=1, status=completed, partition_filter=PartitionKeyFilter(key=partition)
            )
            if not history or history[0].status != AssetCheckExecutionRecordStatus.FAILED:
                continue
            record = history[0]
            evaluation = record.evaluation
            verdict = f" ({evaluation.description})" if evaluation is not None and evaluation.description else ""
            where = f"[{partition}]" if partition is not None else ""
            refused.append(f"{key.asset_key.to_user_string()}{where}: check {key.name} failed{verdict}")
    return refused


def require_passing_checks(
    instance: dg.DagsterInstance, check_keys: Sequence[dg.AssetCheckKey], partitions: Sequence[str | None] = (None,)
) -> None:
    """Raise `dg.Failure` if the latest evaluation of one of `check_keys` on an input partition failed."""
    refused = failed_blocking_checks(instance, check_keys, partitions)
    if refused:
        raise dg.Failure(
            description="refusing inputs whose latest blocking checks failed (fix and rematerialize them): "
            + "; ".join(refused),
            metadata={"refused": dg.MetadataValue.md("\n".join(f"- {line}" for line in refused))},
        )
