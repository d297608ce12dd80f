"""`eagle3-pipeline …`: run the main job on a Dagster instance, or show the pipeline's status."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import CONFIG_ENV_VAR, ConfigError, PipelineConfig, load_config
from eagle3_pipeline.generation import CheckpointError, Progress
from eagle3_pipeline.monitor import HealthMonitor
from eagle3_pipeline.status import (
    RunInFlight,
    dataset_progress,
    exit_code,
    extraction_status,
    render_status,
    status_document,
)

RUN_TAG_PID = "eagle3/cli_pid"
RUN_TAG_HOST = "eagle3/cli_host"
RUN_TAG_STEP = "eagle3/cli_step"
DEFAULT_DAGSTER_HOME = ".dagster_home"
CODE_LOCATION_MODULE = "eagle3_pipeline.definitions"
# Steps run inside the CLI's process (no per-step interpreter start-up); the UI re-executes the
# same jobs with their default executor.
RUN_CONFIG = {"execution": {"config": {"in_process": {}}}, "loggers": {"console": {"config": {"log_level": "INFO"}}}}


def ensure_dagster_home() -> Path:
    """`$DAGSTER_HOME`, default ./.dagster_home, holding this project's dagster.yaml."""
    home = Path(os.environ.get("DAGSTER_HOME") or Path.cwd() / DEFAULT_DAGSTER_HOME).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["DAGSTER_HOME"] = str(home)
    target = home / "dagster.yaml"
    if not target.exists():
        shutil.copyfile(str(resources.files("eagle3_pipeline") / "dagster.yaml"), target)
    return home


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_orphaned_runs(instance: Any) -> list[str]:
    """Mark runs of an earlier `eagle3-pipeline run` that was killed as failed, and free their
    concurrency slots, so the `gpu` pool is not held by a dead process.

    Dagster's run monitoring cannot do this: the CLI executes its runs in its own process, not
    through the instance's run launcher, and the default launcher has no run-worker health check
    either, so a `kill -9` leaves the run STARTED for ever. The CLI tags its runs with its pid and
    host, and the next `eagle3-pipeline run` on that host settles the dead ones."""
    from dagster import DagsterRunStatus, RunsFilter

    unfinished = [
        DagsterRunStatus.STARTED,
        DagsterRunStatus.STARTING,
        DagsterRunStatus.NOT_STARTED,
        DagsterRunStatus.CANCELING,
    ]
    recovered = []
    for run in instance.get_runs(RunsFilter(statuses=unfinished, tags={RUN_TAG_HOST: socket.gethostname()})):
        pid = int(run.tags.get(RUN_TAG_PID, "0"))
        if pid and pid != os.getpid() and not _pid_alive(pid):
            instance.report_run_failed(run, f"the eagle3-pipeline process (pid {pid}) running it died")
            instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
            recovered.append(run.run_id)
    return recovered


class ProgressBar:
    """Generation progress as one self-rewriting terminal line: bar, done/total, tok/s, errors, ETA."""

    width = 28

    def __init__(self, out: Any) -> None:
        self.out = out
        self.open = False

    def render(self, p: Progress) -> str:
        from eagle3_pipeline.generation import format_duration

        filled = round(self.width * p.fraction)
        return (
            f"{p.dataset} [{'#' * filled}{'.' * (self.width - filled)}] {p.done}/{p.total}  "
            f"{p.tokens_per_s:,.0f} tok/s  {p.failed} err  ETA {format_duration(p.eta_s)}"
        )

    def __call__(self, p: Progress) -> None:
        print("\r" + self.render(p) + "\x1b[K", end="", file=self.out, flush=True)
        self.open = True

    def end_line(self) -> None:
        if self.open:
            print(file=self.out, flush=True)
            self.open = False


def progress_from_observation(partition: str, metadata: dict[str, Any]) -> Progress | None:
    """The snapshot a `responses` progress observation carries (None for other observations)."""
    names = [f.name for f in dataclasses.fields(Progress) if f.name != "dataset"]
    if not all(name in metadata for name in names):
        return None
    return Progress(partition, **{name: metadata[name] for name in names})


class RunFollower(threading.Thread):
    """Follows the run tagged `eagle3/cli_step=<step>` through the event log and feeds the
    progress bar from its `responses` progress observations — the same events the UI plots."""

    def __init__(self, instance: Any, step: str, bar: ProgressBar, poll_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.instance = instance
        self.step = step
        self.bar = bar
        self.poll_s = poll_s
        self.done = threading.Event()

    def run(self) -> None:
        from dagster import DagsterEventType, RunsFilter

        run_id, cursor = None, None
        finished = False
        while not finished:
            # One last read after the run ends: its final snapshot may have landed after the last poll.
            finished = self.done.wait(self.poll_s)
            if run_id is None:
                runs = self.instance.get_runs(RunsFilter(tags={RUN_TAG_STEP: self.step}), limit=1)
                if not runs:
                    continue
                run_id = runs[0].run_id
            page = self.instance.get_records_for_run(run_id, cursor=cursor, of_type=DagsterEventType.ASSET_OBSERVATION)
            cursor = page.cursor
            for record in page.records:
                observation = record.asset_observation
                if observation is None or observation.partition is None:
                    continue
                progress = progress_from_observation(
                    observation.partition, {k: v.value for k, v in observation.metadata.items()}
                )
                if progress is not None:
                    self.bar(progress)

    def stop(self) -> None:
        self.done.set()
        self.join()


def failure_detail(events: Sequence[Any]) -> str:
    """Why a run failed, in a line or two: the failed checks' verdicts, else the step's own words
    (a `Failure`'s description, else the root cause of its error)."""
    checks = [
        f"check {e.asset_check_evaluation_data.check_name} on {e.asset_check_evaluation_data.asset_key.to_user_string()}: "
        f"{e.asset_check_evaluation_data.description}"
        for e in events
        if e.event_type_value == "ASSET_CHECK_EVALUATION" and not e.asset_check_evaluation_data.passed
    ]
    if checks:
        return "; ".join(checks)
    failure = next((e for e in events if e.is_step_failure), None)
    if failure is None:
        return "no step failed (see the run in the Dagster UI)"
    data = failure.step_failure_data
    if data.user_failure_data is not None and data.user_failure_data.description:
        return data.user_failure_data.description
    if data.error is None:
        return f"step {failure.step_key} failed"
    error = data.error
    while error.cause is not None:
        error = error.cause
    return error.message.strip()


class MainJob:
    """The main job: the code location's own jobs (`MAIN_PATH`) executed in turn on the instance,
    the partitioned one once per partition. Each is an ordinary run of a named job, with the
    Definitions' resources — the UI shows it and can re-execute it."""

    def __init__(self, config: PipelineConfig, instance: Any, out: Any = sys.stdout) -> None:
        from dagster._core.definitions.reconstruct import ReconstructableRepository

        self.config = config
        self.instance = instance
        self.out = out
        self.repository = ReconstructableRepository.for_module(
            CODE_LOCATION_MODULE, "defs", working_directory=os.getcwd()
        )
        self.bar = ProgressBar(out) if out.isatty() else None
        self.tags = {RUN_TAG_PID: str(os.getpid()), RUN_TAG_HOST: socket.gethostname(), "eagle3/entry": "cli"}
        self.results: dict[str, dict[str, Any]] = {}

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.end_line()
        print(text, file=self.out, flush=True)

    def plan(self) -> list[tuple[str, str | None]]:
        """(job, partition) in execution order, from the code location's own jobs."""
        from eagle3_pipeline.defs.pipeline import MAIN_PATH

        repository = self.repository.get_definition()
        steps: list[tuple[str, str | None]] = []
        for name in MAIN_PATH:
            if not repository.has_job(name):
                continue
            partitions = repository.get_job(name).partitions_def
            if partitions is None:
                steps.append((name, None))
            else:
                steps.extend(
                    (name, key) for key in partitions.get_partition_keys(dynamic_partitions_store=self.instance)
                )
        return steps

    def _execute(self, job_name: str, partition: str | None) -> None:
        import dagster as dg

        step = uuid.uuid4().hex
        tags = {**self.tags, RUN_TAG_STEP: step, **({"dagster/partition": partition} if partition else {})}
        follower = RunFollower(self.instance, step, self.bar) if self.bar is not None else None
        if follower is not None:
            follower.start()
        try:
            result = dg.execute_job(
                self.repository.get_reconstructable_job(job_name),
                instance=self.instance,
                tags=tags,
                run_config=RUN_CONFIG,
                raise_on_error=False,
            )
        finally:
            if follower is not None:
                follower.stop()
        if not result.success:
            raise RuntimeError(f"run {result.run_id} of {job_name} failed: {failure_detail(result.all_events)}")
        for event in result.all_events:
            if event.is_step_materialization:
                mat = event.step_materialization_data.materialization
                key = mat.asset_key.to_user_string() + (f"[{mat.partition}]" if mat.partition else "")
                self.results[key] = {k: v.value for k, v in mat.metadata.items()}

    def run(self) -> None:
        started = time.monotonic()
        for job_name, partition in self.plan():
            self.say(f"» {job_name}" + (f" [{partition}]" if partition else ""))
            self._execute(job_name, partition)
        self.say(self.summary(time.monotonic() - started))

    def summary(self, elapsed_s: float) -> str:
        header = f"{'dataset':<16}{'prompts':>9}{'responses':>11}{'new':>6}{'tokens':>9}{'truncated':>11}"
        lines = ["", header, "-" * len(header)]
        for dataset_id in self.config.dataset_ids:
            p = self.results.get(f"prompts[{dataset_id}]", {})
            r = self.results.get(f"responses[{dataset_id}]", {})
            lines.append(
                f"{dataset_id:<16}{p.get('prompts', 0):>9}{r.get('rows', 0):>11}{r.get('generated_now', 0):>6}"
                f"{r.get('completion_tokens', 0):>9}{r.get('truncated', 0):>11}"
            )
        t = self.results.get("training_data", {})
        lines.append("")
        lines.append(
            f"training_data: {t.get('rows', 0)} rows ({t.get('train_rows', 0)} train / {t.get('eval_rows', 0)} eval), "
            f"{t.get('tokens', 0)} tokens, {t.get('masked_tokens', 0)} masked; "
            f"dropped {t.get('over_length_dropped', 0)} over-length"
        )
        lines += self.eagle3_summary()
        lines.append(f"artifacts: {self.config.artifacts_root}   dagster home: {os.environ['DAGSTER_HOME']}")
        lines.append(f"done in {elapsed_s:.1f} s")
        return "\n".join(lines)

    def eagle3_summary(self) -> list[str]:
        v, h = self.results.get("draft_vocab", {}), self.results.get("hidden_states", {})
        return [
            f"draft_vocab: {v.get('draft_vocab_size', 0)} of {v.get('target_vocab_size', 0)} ids, "
            f"coverage {v.get('coverage', 0):.1%} of masked train tokens ({v.get('eval_coverage', 0):.1%} eval)",
            f"hidden_states: {h.get('samples', 0)} samples, {h.get('tokens', 0)} tokens, {h.get('bytes', 0) / 1e6:.1f} MB, "
            f"{h.get('bytes_per_token', 0)} bytes/token (formula {h.get('bytes_per_token_formula', 0)}), "
            f"{h.get('shards_written', 0)} shards written / {h.get('shards_reused', 0)} reused, in {h.get('store', '-')}",
            *self.drafter_summary(),
        ]

    def drafter_summary(self) -> list[str]:
        """The drafter's training figures, then the closing table: τ per dataset against the bigram."""
        from eagle3_pipeline.drafter.evaluate import summary_table

        d, e = self.results.get("eagle3_drafter"), self.results.get("drafter_eval")
        lines = []
        if d is not None:
            lines.append(
                f"eagle3_drafter: {d.get('steps', 0)} steps, loss {d.get('first_loss', 0):.3f} → {d.get('last_loss', 0):.3f}, "
                f"exported to {d.get('export_dir', '-')}"
            )
        if e is not None:
            lines += [
                "",
                "acceptance length τ on the eval split (greedy chain drafting; bigram drafter for scale):",
                summary_table(e),
            ]
        return lines


def _load(args: argparse.Namespace) -> PipelineConfig | None:
    if args.config:
        os.environ[CONFIG_ENV_VAR] = str(Path(args.config).resolve())
    try:
        return load_config(args.config)
    except ConfigError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return None


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
    config = _load(args)
    if config is None:
        return 2
    try:
        monitor = HealthMonitor(config.for_host(args.host))
    except ConfigError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 2
    try:
        report, _ = monitor.tick()
    finally:
        monitor.close()
    try:
        progress = dataset_progress(config.artifacts_root, config.datasets)
    except CheckpointError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status_document(report, progress), indent=2))
    else:
        print(render_status(report, progress, runs_in_flight(), extraction_status(config.artifacts_root)))
    return exit_code(report)


def cmd_run(args: argparse.Namespace) -> int:
    config = _load(args)
    if config is None:
        return 2
    ensure_dagster_home()
    from dagster import DagsterInstance, PreviewWarning

    warnings.filterwarnings("ignore", category=PreviewWarning)

    instance = DagsterInstance.get()
    for run_id in recover_orphaned_runs(instance):
        print(f"marked run {run_id} failed: its eagle3-pipeline process had died", flush=True)
    job = MainJob(config, instance)
    try:
        job.run()
    except RuntimeError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    config = _load(args)
    if config is None:
        return 2
    from eagle3_pipeline.drafter.scaling import data_scaling
    from eagle3_pipeline.generation.planning import build_plan, calibrate, checkpoint_records, throughput_evidence
    from eagle3_pipeline.hidden_states.disk import config_disk_plan

    try:
        records = checkpoint_records(config)
    except CheckpointError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 1
    throughput = throughput_evidence(config, records)
    failed: dict[str, str] = {}
    if args.calibrate:
        from eagle3_pipeline.serving import InferenceProvider, endpoints_from_config

        provider = InferenceProvider(config)
        try:
            endpoints = provider.endpoints() if provider.embedded else endpoints_from_config(config)
            measured, failed = calibrate(config, endpoints, args.calibrate)
        except (ConfigError, RuntimeError) as exc:
            print(f"eagle3-pipeline: calibration impossible: {exc}", file=sys.stderr)
            return 1
        finally:
            provider.close()
        throughput = {name: measured.get(name) or throughput.get(name) for name in throughput}
    plan = build_plan(config, throughput, records, args.max_cost)
    scaling = data_scaling(config, records, throughput)
    disk = config_disk_plan(config, records, {d: (w.prompt_left, w.completion_left) for d, w in plan.workloads.items()})
    if args.json:
        more_data = scaling if isinstance(scaling, str) else scaling.as_dict()
        disk_data = disk if isinstance(disk, str) else disk.as_dict()
        print(
            json.dumps(
                {
                    **plan.as_dict(),
                    "calibration_failed": failed,
                    "data_scaling": more_data,
                    "hidden_state_disk": disk_data,
                },
                indent=2,
            )
        )
    else:
        print(plan.text())
        for name, reason in failed.items():
            print(f"calibration of {name} failed: {reason}")
        print("\n" + (scaling if isinstance(scaling, str) else scaling.text()))
        print("\n" + (disk if isinstance(disk, str) else disk.text()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-pipeline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="materialize every asset and partition (the main job)")
    run.add_argument("--config", help=f"pipeline file (default: ${CONFIG_ENV_VAR} or the shipped local profile)")
    run.set_defaults(func=cmd_run)
    status = sub.add_parser("status", help="health checks, per-dataset progress and runs in flight")
    status.add_argument("--config", help=f"pipeline file (default: ${CONFIG_ENV_VAR} or the shipped local profile)")
    status.add_argument("--json", action="store_true", help="print {overall, checks, datasets} as JSON")
    status.add_argument("--host", help="with several inference hosts: the one to check (default: the first listed)")
    status.set_defaults(func=cmd_status)
    plan = sub.add_parser(
        "plan",
        help="per dataset and backend: tokens/s, tokens left, ETA, cost, and the best backend; then τ expected from more data of each dataset; "
        "then the hidden states' disk per backend and storage dtype",
    )
    plan.add_argument("--config", help=f"pipeline file (default: ${CONFIG_ENV_VAR} or the shipped local profile)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument(
        "--calibrate", type=int, metavar="N", default=0, help="measure each backend with N real requests first"
    )
    plan.add_argument(
        "--max-cost",
        type=float,
        metavar="USD",
        default=None,
        help="the cost ceiling the best backend must finish within",
    )
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
