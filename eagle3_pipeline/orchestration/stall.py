"""When a running generation or hidden-state extraction counts as stalled: the seconds since it last
showed progress (its heartbeat, its checkpoint, the shards it writes), read by the
`generation_stall` sensor."""

from __future__ import annotations

import time
from pathlib import Path

import dagster as dg

from eagle3_pipeline.generation.heartbeat import heartbeat_path, read_heartbeat
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames


def extracting_runs(instance: dg.DagsterInstance, names: PipelineNames = DEFAULT_NAMES) -> list[dg.RunRecord]:
    """Started runs whose selection includes `hidden_states` (of the pipeline of `names`)."""
    records = instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
    return [r for r in records if names.key("hidden_states") in (r.dagster_run.asset_selection or set())]


def quiet_seconds(artifacts_root: Path, partition: str, run_id: str, now: float | None = None) -> float | None:
    """Seconds since `run_id` last showed progress on `partition`: since it started generating (its
    heartbeat) or its checkpoint last grew, whichever is later; None while it is not generating."""
    beat = read_heartbeat(heartbeat_path(artifacts_root, partition))
    if beat is None or beat.run_id != run_id:
        return None
    checkpoint = ArtifactLayout(artifacts_root).checkpoint(partition)
    try:
        written = checkpoint.stat().st_mtime
    except FileNotFoundError:
        written = 0.0
    return (time.time() if now is None else now) - max(beat.started_at, written)
