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
from typing import Any

import dagster as dg

# The statuses of a finished evaluation (`AssetCheckExecutionRecordStatus` values; the enum is not
# exported by `dagster`, so the records are compared by value).
COMPLETED = {"SUCCEEDED", "FAILED"}
PAGE = 100


def blocking_check_keys(checks: Sequence[dg.AssetChecksDefinition]) -> list[dg.AssetCheckKey]:
    """The keys of the blocking checks among `checks` (e.g. what `build_response_checks` returns)."""
    return sorted((spec.key for c in checks for spec in c.check_specs if spec.blocking), key=lambda key: key.name)


def latest_evaluations(
    instance: dg.DagsterInstance, key: dg.AssetCheckKey, partitions: Sequence[str | None]
) -> dict[str | None, Any]:
    """partition → the latest finished execution record of check `key` on it (absent: none yet),
    paging back through the check's history until every partition has one or the history ends."""
    latest: dict[str | None, Any] = {}
    wanted = set(partitions)
    cursor: int | None = None
    while wanted - set(latest):
        page = instance.event_log_storage.get_asset_check_execution_history(key, limit=PAGE, cursor=cursor)
        for record in page:
            if record.partition in wanted and record.partition not in latest and record.status.value in COMPLETED:
                latest[record.partition] = record
        if len(page) < PAGE:
            break
        cursor = page[-1].id
    return latest


def failed_blocking_checks(
    instance: dg.DagsterInstance, check_keys: Sequence[dg.AssetCheckKey], partitions: Sequence[str | None]
) -> list[str]:
    """`asset[partition]: check (its verdict)` for every latest evaluation that failed."""
    refused = []
    latest = {key: latest_evaluations(instance, key, partitions) for key in check_keys}
    for partition in partitions:
        for key in check_keys:
            record = latest[key].get(partition)
            if record is None or record.status.value != "FAILED":
                continue
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
