"""Several inference hosts (`inference.hosts`): partitions spread over the healthy ones, one run per
host, and a host that turns sick mid-run hands its partition to another without losing or
duplicating an answer. Runs the `inference_health` sensor places carry their host's tag; runs
without one (a backfill's, which share the backfill's tags) claim a host when they start.

Each host is a scripted OpenAI-compatible server on loopback — a stand-in for one 1T-model server —
that can turn sick (HTTP 503 to everything, health probes included) after a given number of
requests. The Dagster instance is real (temporary); the `inference_health` sensor is evaluated with
`build_sensor_context` and each run it requests is executed on that instance with the tags the
daemon gives it (:class:`Daemonless`), so those runs happen one after another; the claiming tests
start untagged runs side by side, in two run-worker processes, against one instance.
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing
import sys
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.cli import main
from eagle3_pipeline.components.pipeline import GENERATION_JOB, build_definitions
from eagle3_pipeline.config import ConfigError, load_config
from eagle3_pipeline.generation.fingerprint import endpoint_identity
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.orchestration.hosts import claim_host
from eagle3_pipeline.orchestration.partition_runs import LaunchHost, claim, failure_reason
from eagle3_pipeline.records import PROMPT_SCHEMA, prompt_rows, read_prompts, write_parquet
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply, Script
from eagle3_pipeline.testing.generation_runs import make_prompts
from eagle3_pipeline_tests.cli_runs import plan_cli
from eagle3_pipeline_tests.dagster_runs import Daemonless, evaluate_at, requested, sensor_resources
from eagle3_pipeline_tests.pipeline_files import load_pipeline, write_pipeline

HOST = "eagle3/host"


def run_tags(instance: dg.DagsterInstance, run_id: str) -> Mapping[str, str]:
    run = instance.get_run_by_id(run_id)
    assert run is not None, f"no run {run_id}"
    return run.tags


def sick_after(requests: int, sick: threading.Event) -> Script:
    """Answer the first `requests` requests, then 503 to every request (completions and health
    probes alike), as a server whose GPUs fell over would; `sick` is set from then on."""

    def script(body: dict[str, Any], number: int) -> Reply:
        if number <= requests:
            return Reply()
        sick.set()
        return Reply(status=503)

    return script


@pytest.fixture
def servers() -> Any:
    a, b = FakeOpenAI(), FakeOpenAI()
    yield a, b
    a.stop()
    b.stop()


def two_hosts(folder: Path, a: FakeOpenAI, b: FakeOpenAI, datasets: dict[str, int]) -> dict[str, Any]:
    """Pipeline sections for inference hosts a (watched on this machine) and b, and ``datasets`` (id: prompts)."""
    for name, count in datasets.items():
        write_jsonl(folder / f"{name}.jsonl", [sharegpt(f"{name} question {i}") for i in range(count)])
    return {
        "name": "two_hosts",
        "target": {"model": "fake", "tokenizer": "unused"},
        "inference": {
            "kind": "endpoints",
            "hosts": [
                {
                    "name": "a",
                    "endpoints": [{"base_url": a.base_url}],
                    "health": {"host": {"kind": "local"}, "expected_gpus": 0},
                },
                {"name": "b", "endpoints": [{"base_url": b.base_url}]},
            ],
        },
        "generation": {
            "max_tokens": 8,
            "concurrency": 2,
            "length_estimator": "chars",  # the fake has no tokenizer
            "max_consecutive_errors": 2,
            "retry": {"max_attempts": 2, "backoff_initial_s": 0.05, "backoff_max_s": 0.1},
        },
        "health": {"host": {"kind": "local"}},
        "launch": {"backoff_initial_s": 600},
        "datasets": [{"id": name, "source": f"{name}.jsonl"} for name in datasets],
    }


def test_a_host_that_turns_sick_mid_run_hands_its_partition_to_another(tmp_path: Path, servers: Any) -> None:
    a, b = servers
    sick = threading.Event()
    # A: one probe by the sensor's tick, one by the run's preflight, then 5 answers; sick from then on.
    a.script = sick_after(7, sick)
    a.start()
    b.start()
    config = load_pipeline(tmp_path, two_hosts(tmp_path, a, b, {"D1": 12, "D2": 3}))
    layout = ArtifactLayout(config.artifacts_root)
    with dg.instance_for_test() as instance:
        loop = Daemonless(build_definitions(config), instance)

        first = loop.tick()
        placed = {r.partition_key: (r.tags[HOST], r.tags["eagle3/pool"]) for r in first.run_requests}
        assert placed == {"D1": ("a", "gpu-a"), "D2": ("b", "gpu-b")}, "spread over the two healthy hosts, one each"
        assert [e.asset_key for e in first.asset_events] == [
            dg.AssetKey(["inference_server", "a"]),
            dg.AssetKey(["inference_server", "b"]),
        ]
        assert sick.is_set(), "A turned sick while generating D1"
        [on_a] = instance.get_runs(dg.RunsFilter(tags={HOST: "a"}))
        assert on_a.status == dg.DagsterRunStatus.FAILURE and on_a.tags["dagster/partition"] == "D1"
        assert "D1: stopped after 2 requests in a row failed (last: HTTP 503" in failure_reason(
            instance, on_a.run_id
        ), "the run stopped"
        answered_by_a = {body["messages"][-1]["content"] for body in a.requests[:7]} - {"Reply with OK."}
        assert len(answered_by_a) == 5 and len(layout.checkpoint("D1").read_text().splitlines()) == 5, (
            "A's 5 answers are checkpointed"
        )

        second = loop.tick()
        [moved] = second.run_requests
        assert (moved.partition_key, moved.tags[HOST], moved.tags["eagle3/attempt"]) == ("D1", "b", "2"), (
            "relaunched at once on the healthy host, not after the 600 s backoff: the failure was A's"
        )
        observed = {e.asset_key.path[-1]: e.metadata["healthy"] for e in second.asset_events}
        assert observed == {"a": dg.BoolMetadataValue(False), "b": dg.BoolMetadataValue(True)}, (
            "one observation per host per tick"
        )

        third = loop.tick()
        assert not third.run_requests
        assert "host a: unhealthy:" in third.skip_message and "host b: healthy" in third.skip_message
        assert "every responses partition is materialized and current" in third.skip_message

        runs = instance.get_runs(dg.RunsFilter(job_name=GENERATION_JOB))
        assert [r.tags[HOST] for r in runs if r.tags[HOST] == "a"] == ["a"], "no run was sent to A after it turned sick"
        [finished] = instance.get_runs(
            dg.RunsFilter(tags={"dagster/partition": "D1"}, statuses=[dg.DagsterRunStatus.SUCCESS])
        )
        assert finished.tags[HOST] == "b" and finished.tags["eagle3/pool"] == "gpu-b"
        [materialized] = [
            m
            for r in instance.get_records_for_run(
                finished.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION
            ).records
            if (m := r.event_log_entry.asset_materialization) is not None and m.asset_key == dg.AssetKey("responses")
        ]
        assert materialized.metadata["host"] == dg.TextMetadataValue("b")
        assert materialized.metadata["already_done"] == dg.IntMetadataValue(5)

    prompt_ids = {p.id for p in read_prompts(layout.prompts("D1"))}
    table_ids = pq.read_table(layout.responses("D1")).column("id").to_pylist()
    checkpoint_ids = [
        json.loads(line)["id"] for line in layout.checkpoint("D1").read_text().splitlines() if line.strip()
    ]
    for ids in (table_ids, checkpoint_ids):
        assert set(ids) == prompt_ids, "0 lost"
        assert max(Counter(ids).values()) == 1, "0 duplicated"
    answered_by_b = {text for text in b.contents if text.startswith("D1 question")}
    assert len(answered_by_b) == 7 and not answered_by_a & answered_by_b, (
        "B resumed where A stopped: it was asked only the other 7"
    )
    assert max(count for text, count in b.contents.items() if text.startswith("D1 question")) == 1
    stored = json.loads(layout.fingerprint("D1").read_text())
    assert stored["endpoints"] == sorted([a.base_url, b.base_url]), "the checkpoint's fingerprint records both hosts"


def test_one_run_per_host_and_the_others_wait_for_a_free_one(tmp_path: Path, servers: Any) -> None:
    a, b = servers
    a.start()
    b.start()
    config = load_pipeline(tmp_path, two_hosts(tmp_path, a, b, {"D1": 1, "D2": 1, "D3": 1}))
    defs = build_definitions(config)
    sensor = defs.resolve_sensor_def("inference_health")
    job = defs.resolve_job_def(GENERATION_JOB)
    with dg.instance_for_test() as instance:

        def tick() -> Any:
            return sensor.evaluate_tick(
                dg.build_sensor_context(instance=instance, definitions=defs, resources=sensor_resources(defs, sensor))
            )

        first = tick()
        assert [(r.partition_key, r.tags[HOST]) for r in first.run_requests] == [("D1", "a"), ("D2", "b")]
        # As the daemon launches them: both runs in flight at once.
        started = {
            r.partition_key: instance.create_run_for_job(
                job, tags={**r.tags, "dagster/partition": r.partition_key}, status=dg.DagsterRunStatus.STARTED
            )
            for r in first.run_requests
        }
        busy = tick()
        assert not busy.run_requests, "no host gets a second run while its first is in flight"
        assert "in flight: D1" in busy.skip_message and "waiting for a free healthy host: D3" in busy.skip_message

        instance.report_run_failed(started["D1"])
        freed = tick()
        assert [(r.partition_key, r.tags[HOST]) for r in freed.run_requests] == [("D3", "a")], (
            "A is free again; D1 backs off"
        )


def test_a_pipeline_file_lists_hosts(tmp_path: Path, servers: Any) -> None:
    a, b = servers
    a.start()
    b.start()
    config = load_pipeline(tmp_path, two_hosts(tmp_path, a, b, {"D1": 1}))
    on_b = config.for_host("b")
    assert [e.base_url for e in on_b.inference.endpoints] == [b.base_url] and not on_b.inference.hosts
    assert on_b.health.min_disk_free_gb == 0.01, "what a host does not set comes from the top-level health section"
    assert config.for_host(None).inference.endpoints == config.for_host("a").inference.endpoints, "None: the first host"
    assert [h.pool_name for h in config.inference.hosts] == ["gpu-a", "gpu-b"]
    single = load_pipeline(
        tmp_path,
        two_hosts(tmp_path, a, b, {"D1": 1}),
        {"inference": {"kind": "endpoints", "endpoints": [{"base_url": a.base_url}], "hosts": []}},
        runtime_checks=True,
    )
    assert single.for_host(None) is single, "a file without hosts is one implicit host, as before"

    def refused(inference: dict[str, Any]) -> str:
        with pytest.raises(ConfigError) as caught:
            load_pipeline(tmp_path, two_hosts(tmp_path, a, b, {"D1": 1}), {"inference": inference}, runtime_checks=True)
        return str(caught.value)

    host = {"name": "a", "endpoints": [{"base_url": a.base_url}]}
    other_model = {"name": "b", "endpoints": [{"base_url": b.base_url, "model": "other"}]}
    assert "every one of inference.hosts must request the same model(s)" in refused(
        {"kind": "endpoints", "hosts": [host, other_model]}
    )
    assert "a: fake; b: other" in refused({"kind": "endpoints", "hosts": [host, other_model]})
    assert "host name(s) ['a'] appear more than once" in refused({"kind": "endpoints", "hosts": [host, host]})
    assert "inference.hosts needs kind 'endpoints'" in refused({"kind": "embedded", "hosts": [host]})
    misplaced = refused({"kind": "endpoints", "hosts": [{**host, "health": {"sensor_interval_s": 60}}]})
    assert "inference.hosts[0] (name 'a').health: " in misplaced and "set in the top-level health section" in misplaced
    assert "inference.hosts[0] (name 'a').endpoints: " in refused(
        {"kind": "endpoints", "hosts": [{"name": "a", "endpoints": []}]}
    )
    with pytest.raises(
        ConfigError,
        match="with inference.hosts, a partition whose host turns sick moves to another healthy host instead",
    ):
        load_pipeline(
            tmp_path,
            two_hosts(tmp_path, a, b, {"D1": 1}),
            {"generation": {"failover": {"backends": [0, 1]}}},
            runtime_checks=True,
        )


def test_status_checks_the_host_it_is_asked_about(
    tmp_path: Path, servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = servers
    a.script = sick_after(0, threading.Event())
    a.start()
    b.start()
    path = str(write_pipeline(tmp_path, two_hosts(tmp_path, a, b, {"D1": 1})))
    assert main(["status", "--config", path, "--json"]) == 1, "the first host by default: A is sick"
    assert json.loads(capsys.readouterr().out)["overall"] == "critical"
    assert main(["status", "--config", path, "--json", "--host", "b"]) == 0
    assert json.loads(capsys.readouterr().out)["overall"] == "ok"
    assert main(["status", "--config", path, "--host", "c"]) == 2
    assert "inference.hosts: no inference host 'c'; inference.hosts names a, b" in capsys.readouterr().err


def test_a_run_placed_on_a_host_that_just_turned_sick_is_refused_by_its_preflight_and_moves(
    tmp_path: Path, servers: Any
) -> None:
    a, b = servers
    a.script = sick_after(1, threading.Event())  # healthy for the sensor's probe, sick by the run's preflight
    a.start()
    b.start()
    config = load_pipeline(tmp_path, two_hosts(tmp_path, a, b, {"D1": 2}))
    with dg.instance_for_test() as instance:
        loop = Daemonless(build_definitions(config), instance)
        assert [r.tags[HOST] for r in loop.tick().run_requests] == ["a"]
        [refused] = instance.get_runs(dg.RunsFilter(tags={HOST: "a"}))
        assert failure_reason(instance, refused.run_id).startswith(
            "health gate refused: unhealthy: generation critical"
        )
        [observed] = instance.get_records_for_run(refused.run_id, of_type=dg.DagsterEventType.ASSET_OBSERVATION).records
        observation = observed.event_log_entry.asset_observation
        assert observation is not None and observation.asset_key == dg.AssetKey(["inference_server", "a"])
        assert not [text for text in a.contents if text.startswith("D1")], "nothing was sent to the sick host"
        assert [(r.partition_key, r.tags[HOST]) for r in loop.tick().run_requests] == [("D1", "b")]
        [done] = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.SUCCESS]))
        assert done.tags[HOST] == "b"


PROBE = "Reply with OK."


def held_until(both: threading.Event, a: FakeOpenAI, b: FakeOpenAI) -> Script:
    """Answer health probes at once; hold every other request until both hosts have been asked
    something (so two runs overlap whatever the machine's load), then answer."""

    def script(body: dict[str, Any], number: int) -> Reply:
        if body["messages"][-1]["content"] != PROBE:
            if any(text != PROBE for text in a.contents) and any(text != PROBE for text in b.contents):
                both.set()
            both.wait(60)  # a bound, not a timing: if both runs went to one host, the other never sets it
        return Reply()

    return script


def execute_partition(config_path: str, partition: str, instance_ref: dg.InstanceRef, tags: dict[str, str]) -> None:
    """A run worker: `generation_job` of one partition on the shared instance; exit 0 when it succeeded."""
    config = load_config(config_path, runtime_checks=False)
    job = build_definitions(config).resolve_job_def(GENERATION_JOB)
    with dg.DagsterInstance.from_ref(instance_ref) as instance:
        result = job.execute_in_process(partition_key=partition, instance=instance, tags=tags, raise_on_error=False)
    sys.exit(0 if result.success else 1)


def start_side_by_side(
    config_path: Path, instance: dg.DagsterInstance, partitions: list[str], tags: dict[str, str]
) -> list[int | None]:
    """Start `generation_job` once per partition, all at once, each in its own process (as run
    workers are) on one instance, with the same `tags` (as a backfill's runs have) and no host tag;
    each worker's exit code."""
    spawn = multiprocessing.get_context("spawn")
    workers = [
        spawn.Process(target=execute_partition, args=(str(config_path), p, instance.get_ref(), tags))
        for p in partitions
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return [worker.exitcode for worker in workers]


@pytest.mark.slow
def test_runs_of_one_backfill_claim_different_hosts_when_they_start(tmp_path: Path, servers: Any) -> None:
    """Two runs of one backfill (same tags, no host tag), started at the same time on two healthy
    hosts: each claims its own host, tags its run with it, and generates there."""
    a, b = servers
    both = threading.Event()
    a.script = b.script = held_until(both, a, b)
    a.start()
    b.start()
    path = write_pipeline(tmp_path, two_hosts(tmp_path, a, b, {"D1": 3, "D2": 3}))
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        assert start_side_by_side(path, instance, ["D1", "D2"], {"dagster/backfill": "bf1"}) == [0, 0]
        runs = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": "bf1"}))
        placed = {r.tags["dagster/partition"]: (r.tags[HOST], r.tags["eagle3/pool"]) for r in runs}
        assert sorted(placed.values()) == [("a", "gpu-a"), ("b", "gpu-b")], f"one run per host: {placed}"
        for partition, (host, _) in placed.items():
            server = a if host == "a" else b
            asked = {text for text in server.contents if text != PROBE}
            assert asked == {f"{partition} question {i}" for i in range(3)}, (
                f"{partition} was generated on host {host} only"
            )


def test_an_untagged_run_never_lands_on_a_sick_host_and_waits_for_a_healthy_one_within_its_bound(
    tmp_path: Path, servers: Any
) -> None:
    a, b = servers
    a.script = sick_after(0, threading.Event())
    a.start()
    b.start()
    config = load_pipeline(tmp_path, two_hosts(tmp_path, a, b, {"D1": 2}), {"launch": {"host_wait_s": 0}})
    defs = build_definitions(config)
    job = defs.resolve_job_def(GENERATION_JOB)
    with dg.instance_for_test() as instance:
        done = job.execute_in_process(partition_key="D1", instance=instance)
        assert done.success and run_tags(instance, done.run_id)[HOST] == "b"
        assert not [text for text in a.contents if text != PROBE], "nothing but health probes was sent to the sick host"

        b.script = sick_after(0, threading.Event())
        refused = job.execute_in_process(partition_key="D1", instance=instance, raise_on_error=False)
        assert not refused.success and HOST not in run_tags(instance, refused.run_id)
        reason = failure_reason(instance, refused.run_id)
        assert (
            "NoHostFree: no healthy inference host was free within launch.host_wait_s = 0 s: no new "
            "partitions for host a: unhealthy" in reason
        )
        assert "; host b: unhealthy" in reason


def test_a_run_without_a_host_tag_waits_while_the_only_healthy_host_is_busy(tmp_path: Path, servers: Any) -> None:
    """B is sick and A holds a run: an untagged run neither takes A nor goes to B; it says what it
    waits for, and takes A once A's run has ended."""
    a, b = servers
    b.script = sick_after(0, threading.Event())
    a.start()
    b.start()
    config = load_pipeline(tmp_path, two_hosts(tmp_path, a, b, {"D1": 1, "D2": 1}), {"launch": {"host_poll_s": 0.01}})
    defs = build_definitions(config)
    job = defs.resolve_job_def(GENERATION_JOB)
    with dg.instance_for_test() as instance:
        holder = instance.create_run_for_job(
            job, tags={HOST: "a", "eagle3/pool": "gpu-a", "dagster/partition": "D2"}, status=dg.DagsterRunStatus.STARTED
        )
        waited: list[str] = []

        def polled(seconds: float) -> None:
            waited.append(f"{seconds}")
            if len(waited) == 3:
                instance.report_run_failed(holder)

        run = instance.create_run_for_job(job, tags={"dagster/partition": "D1"}, status=dg.DagsterRunStatus.STARTED)
        said: list[str] = []
        assert claim_host(instance, run.run_id, config, said.append, sleep=polled) == "a"
        assert len(waited) == 3 and run_tags(instance, run.run_id)[HOST] == "a"
        assert len(said) == 2, f"what it waits for, said once: {said}"
        assert said[0].startswith("waiting for a free healthy inference host: no new partitions for host b: unhealthy")
        assert f"host a busy (run {holder.run_id[:8]})" in said[0]
        assert said[1] == "placed on inference host a (pool gpu-a)"


def test_a_later_run_yields_a_host_claimed_by_an_earlier_one(tmp_path: Path, servers: Any) -> None:
    """Two runs tagged themselves with A at once (each saw A free): the one created later yields, and
    claims B instead."""
    a, b = servers
    a.start()
    b.start()
    config = load_pipeline(tmp_path, two_hosts(tmp_path, a, b, {"D1": 1, "D2": 1}))
    job = build_definitions(config).resolve_job_def(GENERATION_JOB)
    with dg.instance_for_test() as instance:
        first = instance.create_run_for_job(job, tags={"dagster/partition": "D1"}, status=dg.DagsterRunStatus.STARTED)
        later = instance.create_run_for_job(job, tags={"dagster/partition": "D2"}, status=dg.DagsterRunStatus.STARTED)
        on_a = LaunchHost("a", "gpu-a")
        assert claim(instance, later.run_id, on_a) is None, "alone on A so far"
        assert claim(instance, first.run_id, on_a) is None, "created first: A is its own"
        assert claim(instance, later.run_id, on_a) == first.run_id, "created later: yields A"
        assert claim_host(instance, later.run_id, config, lambda line: None) == "b"
        assert {r.run_id: r.tags[HOST] for r in instance.get_runs()} == {first.run_id: "a", later.run_id: "b"}


def test_the_scheduled_backfill_requests_no_more_partitions_than_free_healthy_hosts(
    tmp_path: Path, servers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Three due partitions, two healthy hosts: two are requested, the third waits for the next cron
    tick. With A sick: one, and the tick's log says why A gets none; with both sick: none."""
    caplog.set_level(logging.INFO)
    a, b = servers
    a.start()
    b.start()
    config = load_pipeline(
        tmp_path, two_hosts(tmp_path, a, b, {"D1": 1, "D2": 1, "D3": 1}), {"schedule": {"cron": "* * * * *"}}
    )
    defs = build_definitions(config)
    start = datetime.datetime(2026, 1, 1, 2, 0, 10, tzinfo=datetime.UTC)
    minute = datetime.timedelta(minutes=1)
    with dg.instance_for_test() as instance:
        result = evaluate_at(defs, instance, start)
        result = evaluate_at(defs, instance, start + minute, result.cursor)
        assert requested(result, "responses") == ["D1", "D2"] and requested(result, "prompts") == ["D1", "D2"]
        assert "waiting for a free healthy host: D3" in caplog.text

        a.script = sick_after(0, threading.Event())
        caplog.clear()
        result = evaluate_at(defs, instance, start + 2 * minute, result.cursor)
        assert requested(result, "responses") == ["D1"]
        assert "no new partitions for host a: unhealthy" in caplog.text

        b.script = sick_after(0, threading.Event())
        caplog.clear()
        result = evaluate_at(defs, instance, start + 3 * minute, result.cursor)
        assert result.total_requested == 0
        assert (
            "not backfilling responses: host a: unhealthy: " in caplog.text and "; host b: unhealthy: " in caplog.text
        )


def test_the_scheduled_backfill_retries_at_once_a_partition_that_failed_on_a_host_now_sick(
    tmp_path: Path, servers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """D1's run failed on A, which is now sick: due at the next cron tick, without the 600 s backoff.
    D2's run failed on B, which is healthy: its failure was its own, so it backs off."""
    caplog.set_level(logging.INFO)
    a, b = servers
    a.script = sick_after(0, threading.Event())
    a.start()
    b.start()
    config = load_pipeline(tmp_path, two_hosts(tmp_path, a, b, {"D1": 1, "D2": 1}), {"schedule": {"cron": "* * * * *"}})
    defs = build_definitions(config)
    job = defs.resolve_job_def(GENERATION_JOB)
    start = datetime.datetime(2026, 1, 1, 2, 0, 10, tzinfo=datetime.UTC)
    with dg.instance_for_test() as instance:
        for partition, host in (("D1", "a"), ("D2", "b")):
            tags = {HOST: host, "eagle3/pool": f"gpu-{host}", "dagster/partition": partition}
            instance.report_run_failed(instance.create_run_for_job(job, tags=tags, status=dg.DagsterRunStatus.STARTED))
        result = evaluate_at(defs, instance, start)
        result = evaluate_at(defs, instance, start + datetime.timedelta(minutes=1), result.cursor)
        assert requested(result, "responses") == ["D1"]
        assert "backing off: D2 attempt 2 in " in caplog.text


def test_the_plan_lists_the_endpoints_of_every_host(tmp_path: Path, servers: Any) -> None:
    """`eagle3-pipeline plan --calibrate` on a file with hosts measures each host's endpoint."""
    a, b = servers
    a.start()
    b.start()
    path = write_pipeline(tmp_path, two_hosts(tmp_path, a, b, {"D1": 4}))
    write_parquet(
        prompt_rows(make_prompts(4)), PROMPT_SCHEMA, ArtifactLayout(load_config(path).artifacts_root).prompts("D1")
    )
    [dataset] = json.loads(plan_cli(path, "--json", "--calibrate", "2"))["datasets"]
    rows = {row["backend"]: row for row in dataset["backends"]}
    assert set(rows) == {endpoint_identity(a.base_url), endpoint_identity(b.base_url)}
    assert all(isinstance(row["tokens_per_s"], float) for row in rows.values()), rows
    assert a.requests and b.requests
