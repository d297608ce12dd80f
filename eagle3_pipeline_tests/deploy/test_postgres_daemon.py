"""deploy/ for real: a PostgreSQL-backed instance (deploy/dagster.yaml, unchanged), the code location
in its own `dagster code-server` (deploy/workspace.yaml, unchanged; started by the command line it documents,
on a location file of the test's pipeline file: it listens on 127.0.0.1 only), and the real `dagster-daemon`.

The suite's one run of the real daemon, on five datasets: B1 is materialized before the daemon starts;
B2 and B3 are submitted with `dagster job launch` (as an operator would, through the queued run
coordinator) on the same inference host (`eagle3/host: gpu-a`); at the first cron tick (every minute) the
`pipeline_automation` sensor must emit exactly one Dagster backfill of B4 and B5, the partitions neither
materialized nor in flight. Then every `responses` partition is materialized, B1 once, the two gpu-a runs
never were in flight together although `max_concurrent_runs` would allow it (the tag limit held), and
`training_data` follows by declarative automation, once, over all five. The server is the scripted
OpenAI-compatible server on loopback; the tokenizer is the tiny real model's.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import GENERATION_JOB, build_definitions
from eagle3_pipeline.config import load_config
from eagle3_pipeline.orchestration.partition_runs import IN_FLIGHT
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline.testing.process_tools import free_port
from eagle3_pipeline_tests.dagster_runs import fake_server_sections, materialized
from eagle3_pipeline_tests.deploy.postgres_server import Postgres
from eagle3_pipeline_tests.locations import location_file
from eagle3_pipeline_tests.pipeline_files import write_pipeline

pytestmark = [pytest.mark.local_model, pytest.mark.daemon, pytest.mark.postgres]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HOST_TAG = "eagle3/host"


def documented_code_server(location: Path, port: int) -> list[str]:
    """The `dagster code-server start -f location.py …` line of deploy/workspace.yaml as written, with the test's
    location file and port."""
    [line] = [
        text.lstrip("# ").strip()
        for text in (REPO / "deploy" / "workspace.yaml").read_text().splitlines()
        if "code-server start -f" in text
    ]
    argv = shlex.split(line)
    replaced = {"dagster": str(BIN / "dagster"), "location.py": str(location), "4000": str(port)}
    return [replaced.get(word, word) for word in argv]


@contextmanager
def process(argv: list[str], log: Path, cwd: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A server process in its own session; it and everything it spawned (run workers) are
    terminated at the end."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env={**os.environ}, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def wait_for(
    condition: Callable[[], bool], timeout_s: float, logs: list[Path], procs: list[subprocess.Popen[bytes]]
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
        assert all(p.poll() is None for p in procs), tails
        assert time.monotonic() < deadline, tails
        time.sleep(2)


def test_postgres_instance_daemon_queues_backfills_and_holds_the_host_limit(
    tmp_path: Path, postgres: Postgres, fake_openai: FakeOpenAI, local_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_path = write_pipeline(
        tmp_path,
        fake_server_sections(tmp_path, fake_openai, datasets=("B1", "B2", "B3", "B4", "B5")),
        {"target": {"tokenizer": str(local_model)}, "schedule": {"cron": "* * * * *"}},
    )
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_bytes((REPO / "deploy" / "dagster.yaml").read_bytes())
    code_port = free_port()
    for name, value in {
        **postgres.env(),
        "DAGSTER_HOME": str(home),
        "EAGLE3_CODE_SERVER_HOST": "127.0.0.1",
        "EAGLE3_CODE_SERVER_PORT": str(code_port),
    }.items():
        monkeypatch.setenv(name, value)
    workspace = str(REPO / "deploy" / "workspace.yaml")

    instance = dg.DagsterInstance.get()
    assert type(instance.run_storage).__name__ == "PostgresRunStorage"
    assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
    defs = build_definitions(load_config(config_path))
    assert defs.resolve_job_def(GENERATION_JOB).execute_in_process(partition_key="B1", instance=instance).success

    logs = [tmp_path / "code_server.log", tmp_path / "daemon.log"]
    code_server_argv = documented_code_server(location_file(tmp_path, config_path), code_port)
    with process(code_server_argv, logs[0], tmp_path) as code_server:
        health = [str(BIN / "dagster"), "api", "grpc-health-check", "--host", "127.0.0.1", "--port", str(code_port)]
        wait_for(lambda: subprocess.run(health, capture_output=True).returncode == 0, 180, logs, [code_server])
        table = subprocess.run(["ss", "-Htln"], capture_output=True, text=True, check=True).stdout.splitlines()
        bound = {line.split()[3] for line in table if line.split()[3].endswith(f":{code_port}")}
        # the documented binding, loopback only (gRPC listens on an IPv6 socket, with the IPv4-mapped address)
        assert bound and bound <= {f"127.0.0.1:{code_port}", f"[::ffff:127.0.0.1]:{code_port}"}, bound

        submitted = {}
        for partition in ("B2", "B3"):
            tags = json.dumps({"dagster/partition": partition, HOST_TAG: "gpu-a"})
            launch = subprocess.run(
                [str(BIN / "dagster"), "job", "launch", "-w", workspace, "-j", GENERATION_JOB, "--tags", tags],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert launch.returncode == 0, launch.stdout + launch.stderr
            [run] = instance.get_runs(dg.RunsFilter(job_name=GENERATION_JOB, tags={"dagster/partition": partition}))
            assert run.status == dg.DagsterRunStatus.QUEUED, "no daemon yet: the coordinator must hold the run"
            submitted[partition] = run.run_id

        def done() -> bool:
            """Every partition generated and the automated training_data run over them finished."""
            partitions = {r.partition_key for r in materialized(instance, "responses")}
            return (
                partitions == {"B1", "B2", "B3", "B4", "B5"}
                and bool(materialized(instance, "training_data"))
                and not instance.get_runs(dg.RunsFilter(statuses=IN_FLIGHT))
            )

        with process([str(BIN / "dagster-daemon"), "run", "-w", workspace], logs[1], tmp_path) as daemon:
            wait_for(done, 600, logs, [code_server, daemon])

    responses = materialized(instance, "responses")
    assert sorted(str(r.partition_key) for r in responses) == ["B1", "B2", "B3", "B4", "B5"], (
        "no partition generated twice"
    )

    # B4 and B5 came from the daemon's scheduled backfill; B2 and B3 were in flight, so it left them alone.
    [backfill] = instance.get_backfills()
    assert backfill.tags.get("dagster/sensor_name") == "pipeline_automation"
    assert backfill.asset_backfill_data is not None
    target = backfill.asset_backfill_data.target_subset
    assert sorted(target.get_partitions_subset(dg.AssetKey("responses")).get_partition_keys()) == ["B4", "B5"]
    scheduled = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": backfill.backfill_id}))
    assert sorted(run.tags["dagster/partition"] for run in scheduled) == ["B4", "B5"]
    assert all(run.status == dg.DagsterRunStatus.SUCCESS for run in scheduled)

    # The host limit: the two gpu-a runs, dequeued by the same daemon, one after the other.
    records = {
        r.dagster_run.tags["dagster/partition"]: r
        for r in instance.get_run_records(dg.RunsFilter(tags={HOST_TAG: "gpu-a"}))
    }
    assert set(records) == {"B2", "B3"} and {r.dagster_run.run_id for r in records.values()} == set(submitted.values())
    assert all(r.dagster_run.status == dg.DagsterRunStatus.SUCCESS for r in records.values())
    first, second = sorted(records.values(), key=lambda r: r.start_time or 0.0)
    assert first.end_time is not None and second.start_time is not None
    assert first.end_time <= second.start_time, "two runs of one host were in flight together"
    for record in records.values():
        enqueued = instance.get_records_for_run(
            record.dagster_run.run_id, of_type=dg.DagsterEventType.RUN_ENQUEUED
        ).records
        assert enqueued, "every run went through the queue"
    # training_data followed by declarative automation, once, after the last partition.
    [training] = materialized(instance, "training_data")
    automated = instance.get_run_by_id(training.run_id)
    assert automated is not None and training.asset_materialization is not None
    assert automated.tags.get("dagster/sensor_name") == "pipeline_automation"
    assert automated.status == dg.DagsterRunStatus.SUCCESS, "training_data and its blocking check passed"
    assert training.asset_materialization.metadata["rows"].value == 15
    print(
        f"gpu-a runs: {first.dagster_run.tags['dagster/partition']} ended {second.start_time - first.end_time:.1f} s "
        f"before {second.dagster_run.tags['dagster/partition']} started; B4 and B5 by backfill {backfill.backfill_id}"
    )
