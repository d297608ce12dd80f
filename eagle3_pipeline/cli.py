"""`eagle3-pipeline …`: run the main job on a Dagster instance, show the pipeline's status or plan, or see
and stop its managed inference server."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from eagle3_pipeline.config import ConfigError, PipelineConfig, load_config
from eagle3_pipeline.generation import CheckpointError, Progress
from eagle3_pipeline.monitor import HealthMonitor
from eagle3_pipeline.results import (
    DrafterEvalResult,
    DrafterResult,
    HiddenStatesResult,
    PhaseResult,
    PromptsResult,
    ResponsesResult,
    TrainingDataResult,
)
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
DEFAULT_DAGSTER_HOME = ".dagster_home"
R = TypeVar("R")
# Steps run inside the CLI's process (`execute_in_process`: no per-step interpreter start-up, the
# listener is an object of this process); the UI re-executes the same jobs with their default executor.
RUN_CONFIG = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


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


def _verdict(evaluation: Any) -> str:
    return f"check {evaluation.check_name} on {evaluation.asset_key.to_user_string()}: {evaluation.description}"


def _stops_the_run(evaluation: Any) -> bool:
    """Dagster stops a run on a failed check only when the check blocks and fails with ERROR severity."""
    from dagster import AssetCheckSeverity

    return bool(evaluation.blocking) and evaluation.severity == AssetCheckSeverity.ERROR


def _root_message(error: Any) -> str:
    while error.cause is not None:
        error = error.cause
    return error.message.strip()


def _step_cause(failure: Any, stopping: Sequence[Any]) -> str:
    """Why one step failed: the blocking ERROR checks that stopped it (their verdicts), an
    interruption, a `Failure`'s description, else the root cause of its error."""
    data = failure.step_failure_data
    error = data.error
    if error is not None and error.cls_name == "DagsterAssetCheckFailedError" and stopping:
        return "; ".join(_verdict(e) for e in stopping)
    if error is not None and error.cls_name == "DagsterExecutionInterruptedError":
        return f"step {failure.step_key} was interrupted (its process was stopped)"
    if data.user_failure_data is not None and data.user_failure_data.description:
        return f"step {failure.step_key}: {data.user_failure_data.description}"
    if error is None:
        return f"step {failure.step_key} failed"
    return f"step {failure.step_key}: {_root_message(error)}"


def failure_detail(events: Sequence[Any]) -> str:
    """Why a run failed: the cause — each failed step in its own words, a blocking ERROR check that
    stopped it by its verdict — then, on a line of its own, the checks that failed without stopping
    anything (WARN, or not blocking): context, never the cause."""
    failed_checks = [
        e.asset_check_evaluation_data
        for e in events
        if e.event_type_value == "ASSET_CHECK_EVALUATION" and not e.asset_check_evaluation_data.passed
    ]
    stopping_by_step = {
        e.step_key: [
            c.asset_check_evaluation_data
            for c in events
            if c.event_type_value == "ASSET_CHECK_EVALUATION"
            and c.step_key == e.step_key
            and not c.asset_check_evaluation_data.passed
            and _stops_the_run(c.asset_check_evaluation_data)
        ]
        for e in events
        if e.is_step_failure
    }
    causes = [_step_cause(e, stopping_by_step[e.step_key]) for e in events if e.is_step_failure]
    if not causes:
        causes = [_verdict(c) for c in failed_checks if _stops_the_run(c)]
    if not causes:
        run_failure = next((e for e in events if e.event_type_value == "RUN_FAILURE"), None)
        error = getattr(run_failure.event_specific_data, "error", None) if run_failure is not None else None
        causes = [_root_message(error) if error is not None else "no step failed (see the run in the Dagster UI)"]
    context = [
        f"check {c.check_name} on {c.asset_key.to_user_string()} ({c.severity.value})"
        for c in failed_checks
        if not _stops_the_run(c)
    ]
    also = f"\n  also failed, without stopping the run: {', '.join(context)}" if context else ""
    return "; ".join(causes) + also


class _FailureHeadline(logging.Filter):
    """On the terminal, Dagster's line for a failed step or run keeps its headline; the error and its
    traceback, which Dagster appends to it, stay in the run's event log."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno >= logging.ERROR and "\nStack Trace:\n" in message:
            record.msg, record.args = message.split("\n\n", 1)[0] + " (error and traceback: the run's event log)", ()
        return True


def _cli_console_logger() -> Any:
    """Dagster's colored console logger, with :class:`_FailureHeadline` (the CLI's runs print to a terminal)."""
    import dagster as dg

    @dg.logger(
        config_schema=dg.colored_console_logger.config_schema,
        description="Dagster's colored console logger; a failure's traceback stays in the run's event log.",
    )
    def console(init_context: dg.InitLoggerContext) -> logging.Logger:
        logger = dg.colored_console_logger.logger_fn(init_context)
        logger.addFilter(_FailureHeadline())
        return logger

    return console


class CliListener:
    """What `eagle3-pipeline run` hears from its runs in its own process: generation progress
    (drawn on the bar when there is a terminal) and each phase's typed result, by asset key."""

    def __init__(self, bar: ProgressBar | None) -> None:
        self.bar = bar
        self.results: dict[str, PhaseResult] = {}

    def progress(self, snapshot: Progress) -> None:
        if self.bar is not None:
            self.bar(snapshot)

    def result(self, asset: str, partition: str | None, result: PhaseResult) -> None:
        self.results[asset + (f"[{partition}]" if partition else "")] = result

    def get(self, key: str, kind: type[R]) -> R | None:
        """The result recorded under ``key``, of type ``kind``; another type is an error, not a guess."""
        result = self.results.get(key)
        if result is not None and not isinstance(result, kind):
            raise TypeError(f"the result of {key} is a {type(result).__name__}, not a {kind.__name__}")
        return result

    def require(self, key: str, kind: type[R]) -> R:
        result = self.get(key, kind)
        if result is None:
            raise RuntimeError(f"no {key} result reached the summary (its run reported none)")
        return result


class MainJob:
    """The main job: the code location's own jobs (`MAIN_PATH`) executed in turn on the instance,
    the partitioned one once per partition, in this process. Each is an ordinary run of a named job
    with the Definitions' resources — the UI shows it and can re-execute it — plus this process's
    listener, through which progress and phase results reach the summary."""

    def __init__(self, config: PipelineConfig, defs: Any, instance: Any, out: Any = sys.stdout) -> None:
        self.config = config
        self.defs = defs
        self.instance = instance
        self.out = out
        self.bar = ProgressBar(out) if out.isatty() else None
        self.listener = CliListener(self.bar)
        self.tags = {RUN_TAG_PID: str(os.getpid()), RUN_TAG_HOST: socket.gethostname(), "eagle3/entry": "cli"}

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.end_line()
        print(text, file=self.out, flush=True)

    def plan(self) -> list[tuple[str, str | None]]:
        """(job, partition) in execution order, from the code location's own jobs."""
        from eagle3_pipeline.components.pipeline import MAIN_PATH

        jobs = {job.name: job for job in self.defs.resolve_all_job_defs()}
        steps: list[tuple[str, str | None]] = []
        for name in MAIN_PATH:
            if name not in jobs:
                continue
            partitions = jobs[name].partitions_def
            if partitions is None:
                steps.append((name, None))
            else:
                steps.extend(
                    (name, key) for key in partitions.get_partition_keys(dynamic_partitions_store=self.instance)
                )
        return steps

    def execute(self, job_name: str, partition: str | None) -> None:
        """One run of the named job (one partition of it), on the instance, heard by the listener."""
        job = self.defs.resolve_job_def(job_name).with_logger_defs({"console": _cli_console_logger()})
        result = job.execute_in_process(
            instance=self.instance,
            partition_key=partition,
            tags=self.tags,
            run_config=RUN_CONFIG,
            resources={"phase_listener": self.listener},
            raise_on_error=False,
        )
        if not result.success:
            raise RuntimeError(
                f"run {result.run_id} of {job_name} failed: {failure_detail(result.all_events)}\n"
                f"  error, traceback and logs: run {result.run_id} in the Dagster UI "
                f"(DAGSTER_HOME={os.environ.get('DAGSTER_HOME', '')} dagster dev)"
            )

    def run(self) -> None:
        started = time.monotonic()
        for job_name, partition in self.plan():
            self.say(f"» {job_name}" + (f" [{partition}]" if partition else ""))
            self.execute(job_name, partition)
        self.say(self.summary(time.monotonic() - started))

    def summary(self, elapsed_s: float) -> str:
        header = f"{'dataset':<16}{'prompts':>9}{'responses':>11}{'new':>6}{'tokens':>9}{'truncated':>11}"
        lines = ["", header, "-" * len(header)]
        for dataset_id in self.config.dataset_ids:
            p = self.listener.require(f"prompts[{dataset_id}]", PromptsResult)
            r = self.listener.require(f"responses[{dataset_id}]", ResponsesResult)
            lines.append(
                f"{dataset_id:<16}{p.prompts:>9}{r.rows:>11}{r.generated_now:>6}"
                f"{r.completion_tokens:>9}{r.truncated:>11}"
            )
        t = self.listener.require("training_data", TrainingDataResult)
        lines.append("")
        lines.append(
            f"training_data: {t.rows} rows ({t.train_rows} train / {t.eval_rows} eval), "
            f"{t.tokens} tokens, {t.masked_tokens} masked; "
            f"dropped {t.over_length_dropped} over-length"
        )
        lines += self.eagle3_summary()
        lines.append(f"artifacts: {self.config.artifacts_root}   dagster home: {os.environ['DAGSTER_HOME']}")
        lines.append(f"done in {elapsed_s:.1f} s")
        return "\n".join(lines)

    def eagle3_summary(self) -> list[str]:
        from eagle3_pipeline.draft_vocab import DraftVocabResult

        v = self.listener.require("draft_vocab", DraftVocabResult)
        h = self.listener.require("hidden_states", HiddenStatesResult)
        shards = (
            f"{h.shards} shards imported"
            if h.shards_written is None or h.shards_reused is None
            else f"{h.shards_written} shards written / {h.shards_reused} reused"
        )
        return [
            f"draft_vocab: {v.draft_vocab_size} of {v.target_vocab_size} ids, "
            f"coverage {v.coverage:.1%} of masked train tokens ({v.eval_coverage:.1%} eval)",
            f"hidden_states: {h.samples} samples, {h.tokens} tokens, {h.bytes / 1e6:.1f} MB, "
            f"{h.bytes_per_token} bytes/token (formula {h.bytes_per_token_formula}), {shards}, in {h.store}",
            *self.drafter_summary(),
        ]

    def drafter_summary(self) -> list[str]:
        """The drafter's training figures, then the closing table: τ per dataset against the bigram."""
        from eagle3_pipeline.drafter.eval_results import summary_table

        d = self.listener.get("eagle3_drafter", DrafterResult)
        e = self.listener.get("drafter_eval", DrafterEvalResult)
        lines = []
        if d is not None:
            trained = d.first_loss is not None and d.last_loss is not None
            loss = f"loss {d.first_loss:.3f} → {d.last_loss:.3f}" if trained else "no step trained in this run"
            lines.append(f"eagle3_drafter: {d.steps} steps, {loss}, exported to {d.export_dir}")
        if e is not None:
            lines += [
                "",
                "acceptance length τ on the eval split (greedy chain drafting; bigram drafter for scale):",
                summary_table(e.as_metadata()),
            ]
        return lines


def _load(args: argparse.Namespace, runtime_checks: bool = True) -> PipelineConfig | None:
    try:
        return load_config(args.config, runtime_checks=runtime_checks)
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
    from dagster import DagsterInstance

    from eagle3_pipeline.components import build_definitions

    defs = build_definitions(config)
    instance = DagsterInstance.get()
    for run_id in recover_orphaned_runs(instance):
        print(f"marked run {run_id} failed: its eagle3-pipeline process had died", flush=True)
    job = MainJob(config, defs, instance)
    try:
        job.run()
    except RuntimeError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    # The plan reads the artifacts, not the sources: a box whose prompt files are elsewhere plans too
    # (a calibration's endpoints check their keys themselves).
    config = _load(args, runtime_checks=False)
    if config is None:
        return 2
    from eagle3_pipeline.drafter.scaling import data_scaling
    from eagle3_pipeline.generation.planning import build_plan, calibrate, checkpoint_records, throughput_evidence
    from eagle3_pipeline.hidden_states.disk import config_disk_plan
    from eagle3_pipeline.schedule import serving_schedule

    try:
        records = checkpoint_records(config)
    except CheckpointError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 1
    throughput = throughput_evidence(config.inference, config.target.model, records)
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
    schedule = serving_schedule(config, plan, records)
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
                    "schedule": schedule.as_dict(),
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
        print("\n" + schedule.text())
    return 0


SERVER_EXIT = {"running": 0, "absent": 3, "exited": 3, "orphaned": 1, "foreign": 1}


def _server_status_lines(plan: Any, status: Any) -> list[str]:
    lines = [f"managed server {plan.name} ({plan.engine}, {plan.setting}) on port {plan.port}: {status.state}"]
    record = status.record
    if record is not None:
        lines.append(
            f"  role {record.role}, pid {record.pid} (process group {record.pgid}), started {record.started_at}: "
            f"{record.reason}"
        )
        lines.append(f"  command: {shlex.join(record.argv)}")
        lines.append(f"  log: {record.log_path}")
    lines.append(f"  {status.detail}")
    return lines


def _stop_lines(result: Any) -> list[str]:
    check = result.verification
    if result.was_running:
        head = (
            f"stopped the {result.role} server (pid {result.pid}) on {result.host} in {result.duration_s:.1f} s "
            f"({', '.join(result.signals)})"
        )
    else:
        head = f"no server of the pipeline's was running on {result.host}"
    return [
        head,
        f"  verified: {len(check.processes_left)} process(es) of it left; port {check.port} "
        + ("free" if not check.port_holders else "held")
        + f"; GPUs {check.gpu_check}",
    ]


def cmd_server(args: argparse.Namespace) -> int:
    """`server status|stop`: the managed server's state from its pid file, or its verified stop."""
    try:
        config = load_config(args.config, runtime_checks=False)
    except ConfigError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 2
    from eagle3_pipeline.hosts import build_host
    from eagle3_pipeline.managed import ManagedServer, ManagedServerError, StopNotVerifiedError, managed_server

    plan = managed_server(config, args.host)
    if plan is None:
        where = f"inference host {args.host!r}" if args.host else "it"
        print(
            f"eagle3-pipeline: {config.source_file}: no managed server (serving.managed) for {where}: the pipeline "
            "starts and stops no server",
            file=sys.stderr,
        )
        return 2
    host = build_host(plan.host)
    try:
        server = ManagedServer(host, plan)
        if args.action == "status":
            status = server.status()
            print("\n".join(_server_status_lines(plan, status)))
            return SERVER_EXIT[status.state]
        print("\n".join(_stop_lines(server.stop("eagle3-pipeline server stop"))))
        return 0
    except StopNotVerifiedError as exc:
        print("\n".join(_stop_lines(exc.result)), file=sys.stderr)
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 1
    except ManagedServerError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 1
    finally:
        host.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-pipeline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="materialize every asset and partition (the main job)")
    run.add_argument(
        "--config", help="pipeline file (default: the shipped local profile, the one the code location loads)"
    )
    run.set_defaults(func=cmd_run)
    status = sub.add_parser("status", help="health checks, per-dataset progress and runs in flight")
    status.add_argument(
        "--config", help="pipeline file (default: the shipped local profile, the one the code location loads)"
    )
    status.add_argument("--json", action="store_true", help="print {overall, checks, datasets} as JSON")
    status.add_argument("--host", help="with several inference hosts: the one to check (default: the first listed)")
    status.set_defaults(func=cmd_status)
    plan = sub.add_parser(
        "plan",
        help="per dataset and backend: tokens/s, tokens left, ETA, cost, and the best backend; "
        "then τ expected from more data of each dataset; "
        "then the hidden states' disk per backend and storage dtype; "
        "then the schedule on the GPU host: the managed server's starts and stops before each phase, and each "
        "phase's GPU time with its basis",
    )
    plan.add_argument(
        "--config", help="pipeline file (default: the shipped local profile, the one the code location loads)"
    )
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
    server = sub.add_parser(
        "server",
        help="the managed inference server (serving.managed): its state (exit 0 running, 3 not running, 1 "
        "processes of it left without its leader or a foreign pid), or stop it, verified (processes, port, GPUs)",
    )
    server.add_argument("action", choices=["status", "stop"])
    server.add_argument(
        "--config", help="pipeline file (default: the shipped local profile, the one the code location loads)"
    )
    server.add_argument("--host", help="with several inference hosts: whose managed server (default: the first)")
    server.set_defaults(func=cmd_server)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
