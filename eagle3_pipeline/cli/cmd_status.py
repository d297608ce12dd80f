"""`eagle3-pipeline status`: the health report, per-dataset progress and the runs in flight."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from eagle3_pipeline.cli.errors import ExitCode, fail
from eagle3_pipeline.cli.shared import DEFAULT_DAGSTER_HOME, load_or_report
from eagle3_pipeline.cli.status import (
    RunInFlight,
    dataset_progress,
    exit_code,
    extraction_status,
    render_status,
    status_document,
)
from eagle3_pipeline.config import ConfigError
from eagle3_pipeline.generation import CheckpointError
from eagle3_pipeline.health.gate import HealthMonitor


def runs_in_flight() -> list[RunInFlight]:
    """Unfinished runs on the instance at $DAGSTER_HOME (default ./.dagster_home), if it exists."""
    home = Path(os.environ.get("DAGSTER_HOME") or Path.cwd() / DEFAULT_DAGSTER_HOME)
    if not (home / "dagster.yaml").exists():
        return []
    os.environ["DAGSTER_HOME"] = str(home.resolve())
    from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

    unfinished = [DagsterRunStatus.QUEUED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]
    now = time.time()
    with DagsterInstance.get() as instance:
        records = instance.get_run_records(RunsFilter(statuses=unfinished))
    return [
        RunInFlight(
            r.dagster_run.run_id,
            r.dagster_run.job_name,
            r.dagster_run.tags.get("dagster/partition"),
            r.dagster_run.status.value,
            now - r.start_time if r.start_time else None,
        )
        for r in records
    ]


def cmd_status(args: argparse.Namespace) -> int:
    # What this machine lacks (prompt files, API keys) is a finding of the report, not a bad file.
    config = load_or_report(args, runtime_checks=False)
    if config is None:
        return ExitCode.BAD_INPUT
    try:
        monitor = HealthMonitor(config.for_host(args.host))
    except ConfigError as exc:
        return fail(str(exc), ExitCode.BAD_INPUT)
    try:
        report, _ = monitor.tick()
    finally:
        monitor.close()
    try:
        progress = dataset_progress(config)
    except CheckpointError as exc:
        return fail(str(exc), ExitCode.UNHEALTHY)
    if args.json:
        print(json.dumps(status_document(report, progress), indent=2))
    else:
        print(render_status(report, progress, runs_in_flight(), extraction_status(config.artifacts_root)))
        print(f"artifacts: {config.artifacts_root}")
    return exit_code(report)
