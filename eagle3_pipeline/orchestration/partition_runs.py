"""Which `responses` partitions to launch now, with which run key — the state is Dagster's run history.

The last step of the one launch decision (:func:`eagle3_pipeline.orchestration.generation_decision.decide_generation`)
that the `inference_health` sensor and the scheduled backfill's condition share, so neither thrashes.
A partition's runs are those tagged with it that ran `generation_job` or selected `prompts` or
`responses` (a backfill's runs):
- a partition with a run QUEUED, NOT_STARTED, STARTING, STARTED or CANCELING is in flight (a
  canceling run still holds the checkpoint lock);
- after k consecutive failed runs (FAILURE or CANCELED since its last success) the next attempt
  waits `launch.backoff_initial_s × 2^(k-1)` (at most `launch.backoff_max_s`) from the last failure's end;
- after `launch.max_attempts` consecutive failures the partition is left alone, with the last
  failure's reason in the tick, until a run of it succeeds (e.g. re-executed from the UI);
- the run key is `<partition>:<epoch>:attempt-<n>`, where the epoch is the last successful run,
  so each attempt is launched once however many ticks see it;
- with several inference hosts (:class:`HostChoice`), at most as many partitions as there are free
  healthy hosts — no run in flight tagged with the host (`eagle3/host`) or its pool (`eagle3/pool`),
  less one per generation run not placed yet — each request tagged with its host (the sensor's; the
  scheduled backfill's runs share the backfill's tags, so they :func:`claim` a host when they start);
  a partition whose last run failed on a host that is now unhealthy is due at once (the failure was
  the host's), without its backoff but counted as an attempt.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from eagle3_pipeline.config import LaunchConfig
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames

GENERATION_JOB = DEFAULT_NAMES.generation_job
PARTITION_TAG = "dagster/partition"
# The assets partitioned by dataset: a run of either generates the partition it is tagged with.
PER_DATASET = ("prompts", "responses")
HISTORY = 100
HOST_TAG = "eagle3/host"
POOL_TAG = "eagle3/pool"
IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]
FAILED = {dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


@dataclass
class TickLaunches:
    """The run requests of one tick, and why every other wanted partition was not launched."""

    requests: list[dg.RunRequest] = field(default_factory=list)
    in_flight: list[str] = field(default_factory=list)
    backing_off: list[str] = field(default_factory=list)
    given_up: list[str] = field(default_factory=list)
    waiting_for_host: list[str] = field(default_factory=list)

    def reasons(self) -> str:
        parts = []
        if self.in_flight:
            parts.append("in flight: " + ", ".join(self.in_flight))
        if self.waiting_for_host:
            parts.append("waiting for a free healthy host: " + ", ".join(self.waiting_for_host))
        if self.backing_off:
            parts.append("backing off: " + "; ".join(self.backing_off))
        if self.given_up:
            parts.append("left alone: " + "; ".join(self.given_up))
        return "; ".join(parts)


@dataclass(frozen=True)
class LaunchHost:
    name: str
    pool: str


@dataclass(frozen=True)
class HostChoice:
    """The hosts of one tick: the healthy ones (in the file's order) and the names of the others."""

    healthy: Sequence[LaunchHost]
    unhealthy: frozenset[str]


@dataclass(frozen=True)
class HostsInFlight:
    """Who holds the inference hosts now: host → the unfinished runs tagged with it, the pools those
    runs hold, and the unfinished generation runs not placed yet (each claims a host when it starts)."""

    hosts: dict[str, list[str]]
    pools: set[str]
    unplaced: list[str]

    def free(self, choice: HostChoice) -> list[LaunchHost]:
        """The healthy hosts whose host and pool nobody holds (one host per pool), less one for each
        unplaced run, since it will take one of them."""
        free: list[LaunchHost] = []
        for host in choice.healthy:
            if host.name not in self.hosts and host.pool not in self.pools and host.pool not in {h.pool for h in free}:
                free.append(host)
        return free[: max(0, len(free) - len(self.unplaced))]


def generates(run: dg.DagsterRun, names: PipelineNames) -> bool:
    """A run that sends requests to an inference host: the generation job of the pipeline of `names`,
    or a selection with its `responses` (a backfill's run, or one launched from the UI)."""
    return run.job_name == names.generation_job or names.key("responses") in (run.asset_selection or set())


def generates_partitions(run: dg.DagsterRun, names: PipelineNames) -> bool:
    """A run of a dataset partition of the pipeline of `names`: its generation job, or a selection
    with its `prompts` or `responses`."""
    per_dataset = {names.key(asset) for asset in PER_DATASET}
    return run.job_name == names.generation_job or bool(per_dataset & set(run.asset_selection or ()))


def hosts_in_flight(instance: dg.DagsterInstance, names: PipelineNames, besides: str | None = None) -> HostsInFlight:
    """Every unfinished run's hold on the inference hosts (the run `besides` left out); the runs not
    placed yet are the generating runs of the pipeline of `names`."""
    hosts: dict[str, list[str]] = {}
    pools: set[str] = set()
    unplaced: list[str] = []
    for run in instance.get_runs(dg.RunsFilter(statuses=IN_FLIGHT)):
        if run.run_id == besides:
            continue
        if HOST_TAG in run.tags:
            hosts.setdefault(run.tags[HOST_TAG], []).append(run.run_id)
        elif generates(run, names):
            unplaced.append(run.run_id)
        if POOL_TAG in run.tags:
            pools.add(run.tags[POOL_TAG])
    return HostsInFlight(hosts, pools, unplaced)


def claim(instance: dg.DagsterInstance, run_id: str, host: LaunchHost) -> str | None:
    """Tag run `run_id` with `host` and its pool (as the UI's "add tags" does), then look again: the
    id of an unfinished run that holds the same host or pool and was created first (tie: the smaller
    run id) — this run then yields, and tries another host — else None: the host is this run's."""
    instance.add_run_tags(run_id, {HOST_TAG: host.name, POOL_TAG: host.pool})
    mine = instance.get_run_record_by_id(run_id)
    rank = (mine.create_timestamp if mine is not None else None, run_id)
    for record in instance.get_run_records(dg.RunsFilter(statuses=IN_FLIGHT)):
        run = record.dagster_run
        if run.run_id == run_id or (run.tags.get(HOST_TAG) != host.name and run.tags.get(POOL_TAG) != host.pool):
            continue
        if rank[0] is None or (record.create_timestamp, run.run_id) < rank:
            return run.run_id
    return None


def backoff_s(failures: int, settings: LaunchConfig) -> float:
    """The wait before the attempt that follows `failures` consecutive failures (≥ 1)."""
    return float(min(settings.backoff_initial_s * 2 ** (failures - 1), settings.backoff_max_s))


def partitions_in_flight(instance: dg.DagsterInstance, names: PipelineNames = DEFAULT_NAMES) -> dict[str, str]:
    """partition → run id, for every unfinished (or still canceling) run that targets a partition;
    with a prefix in `names`, only the runs of that pipeline's dataset partitions (the pipeline without
    a prefix counts every partitioned run, as it did alone in its code location)."""
    runs = instance.get_runs(dg.RunsFilter(statuses=IN_FLIGHT))
    return {
        run.tags[PARTITION_TAG]: run.run_id
        for run in runs
        if PARTITION_TAG in run.tags and (names.prefix is None or generates_partitions(run, names))
    }


def failure_reason(instance: dg.DagsterInstance, run_id: str) -> str:
    """The first line of why a run failed: its failed step's own words (a `Failure`'s description,
    else the root cause of the error), else the run's message."""
    for event_type in (
        dg.DagsterEventType.STEP_FAILURE,
        dg.DagsterEventType.RUN_FAILURE,
        dg.DagsterEventType.RUN_CANCELED,
    ):
        records = instance.get_records_for_run(run_id, of_type=event_type, limit=1).records
        if not records:
            continue
        event = records[0].event_log_entry.dagster_event
        text = records[0].event_log_entry.message or event_type.value
        if event is not None and event.is_step_failure:
            data = event.step_failure_data
            if data.user_failure_data is not None and data.user_failure_data.description:
                text = data.user_failure_data.description
            elif data.error is not None:
                text = _root_cause(data.error)
        elif event is not None and (error := getattr(event.event_specific_data, "error", None)) is not None:
            text = _root_cause(error)  # the run failed outside a step, e.g. a resource's setup
        return text.strip().splitlines()[0]
    return "no failure event recorded"


def _root_cause(error: Any) -> str:
    while error.cause is not None:
        error = error.cause
    return error.message


def decide_launches(
    instance: dg.DagsterInstance,
    names: PipelineNames,
    *,
    wanted: Sequence[str],
    settings: LaunchConfig,
    tags: dict[str, str] | None = None,
    now: float | None = None,
    hosts: HostChoice | None = None,
) -> TickLaunches:
    """Run requests for the `wanted` partitions that are neither in flight, nor backing off, nor given
    up; with `hosts`, each on a free healthy host (the others wait for one). The runs looked at are
    those of the pipeline of `names`."""
    now = time.time() if now is None else now
    launches = TickLaunches()
    busy = partitions_in_flight(instance, names)
    free = hosts_in_flight(instance, names).free(hosts) if hosts is not None else []
    for partition in wanted:
        if partition in busy:
            launches.in_flight.append(f"{partition} (run {busy[partition][:8]})")
            continue
        records = [
            r
            for r in instance.get_run_records(dg.RunsFilter(tags={PARTITION_TAG: partition}), limit=HISTORY)
            if generates_partitions(r.dagster_run, names)
        ][: settings.max_attempts + 1]
        failures = []
        epoch = "first"
        for record in records:
            if record.dagster_run.status in FAILED:
                failures.append(record)
                continue
            if record.dagster_run.status == dg.DagsterRunStatus.SUCCESS:
                epoch = record.dagster_run.run_id[:8]
            break
        if len(failures) >= settings.max_attempts:
            reason = failure_reason(instance, failures[0].dagster_run.run_id)
            launches.given_up.append(
                f"{partition} failed {len(failures)} times in a row (last: {reason}); re-execute it to try again"
            )
            continue
        if failures:
            last = failures[0]
            ended = last.end_time or last.update_timestamp.timestamp()
            due = ended + backoff_s(len(failures), settings)
            host_failed = hosts is not None and last.dagster_run.tags.get(HOST_TAG) in hosts.unhealthy
            if now < due and not host_failed:
                launches.backing_off.append(f"{partition} attempt {len(failures) + 1} in {math.ceil(due - now)} s")
                continue
        placed: dict[str, str] = {}
        if hosts is not None:
            if not free:
                launches.waiting_for_host.append(partition)
                continue
            host = free.pop(0)
            placed = {HOST_TAG: host.name, POOL_TAG: host.pool}
        launches.requests.append(
            dg.RunRequest(
                run_key=f"{partition}:{epoch}:attempt-{len(failures) + 1}",
                partition_key=partition,
                tags={**(tags or {}), **placed, "eagle3/attempt": str(len(failures) + 1)},
            )
        )
    return launches
