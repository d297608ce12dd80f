"""The scheduled backfill, fired by the real `dagster-daemon` on a temporary instance.

B1 is materialized before the daemon starts; at the first cron tick (every minute) the
`pipeline_automation` sensor must emit exactly one Dagster backfill of B2 and B3, and `training_data`
must then follow by declarative automation. The server is the scripted
OpenAI-compatible server on loopback; the tokenizer is the tiny real model's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import load_config
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline_tests.dagster_runs import fake_server_sections, materialized
from eagle3_pipeline_tests.locations import workspace_file
from eagle3_pipeline_tests.pipeline_files import write_pipeline

pytestmark = [pytest.mark.local_model, pytest.mark.daemon]

REPO = Path(__file__).resolve().parents[2]


def test_the_daemon_backfills_exactly_the_missing_partitions_then_automation_follows(
    tmp_path: Path, fake_openai: FakeOpenAI, local_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_path = write_pipeline(
        tmp_path,
        fake_server_sections(tmp_path, fake_openai, datasets=("B1", "B2", "B3")),
        {"target": {"tokenizer": str(local_model)}, "schedule": {"cron": "* * * * *"}},
    )
    home = tmp_path / "home"
    home.mkdir()
    shutil.copyfile(REPO / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))

    instance = dg.DagsterInstance.get()
    defs = build_definitions(load_config(config_path))
    assert defs.resolve_job_def("generation_job").execute_in_process(partition_key="B1", instance=instance).success

    daemon = subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", str(workspace_file(tmp_path, config_path))],
        cwd=tmp_path,
        env={**os.environ},
        stdout=(tmp_path / "daemon.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600

        def automated_run_finished() -> bool:
            records = materialized(instance, "training_data")
            run = instance.get_run_by_id(records[0].run_id) if records else None
            return run is not None and run.is_finished

        while not automated_run_finished():
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "daemon.log").read_text()[-3000:]
            time.sleep(2)
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(timeout=60)

    [backfill] = instance.get_backfills()
    assert backfill.tags.get("dagster/sensor_name") == "pipeline_automation"
    assert backfill.asset_backfill_data is not None
    target = backfill.asset_backfill_data.target_subset
    assert sorted(target.get_partitions_subset(dg.AssetKey("responses")).get_partition_keys()) == ["B2", "B3"]
    assert sorted(target.get_partitions_subset(dg.AssetKey("prompts")).get_partition_keys()) == ["B2", "B3"]
    scheduled = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill.backfill_id}))
    assert sorted(run.tags["dagster/partition"] for run in scheduled) == ["B2", "B3"]
    assert all(run.status == dg.DagsterRunStatus.SUCCESS for run in scheduled)
    partitions = [str(r.partition_key) for r in materialized(instance, "responses")]
    assert sorted(partitions) == ["B1", "B2", "B3"], "B1 was not generated again"
    [training] = materialized(instance, "training_data")
    automated = instance.get_run_by_id(training.run_id)
    assert automated is not None and training.asset_materialization is not None
    assert automated.tags.get("dagster/sensor_name") == "pipeline_automation"
    assert automated.status == dg.DagsterRunStatus.SUCCESS, "training_data and its blocking check passed"
    assert training.asset_materialization.metadata["rows"].value == 9
