"""`eagle3-pipeline run`: the main job on the Dagster instance at $DAGSTER_HOME, with a progress bar, each
phase's result as it lands, and why a run failed in the phase's own words."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from eagle3_pipeline.cli.errors import HOST_ERROR_CODES, ExitCode
from eagle3_pipeline.cli.shared import ensure_dagster_home, load_or_report
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation import Progress
from eagle3_pipeline.results import (
    DrafterEvalResult,
    DrafterResult,
    HiddenStatesResult,
    PhaseResult,
    PromptsResult,
    ResponsesResult,
    TrainingDataResult,
)

RUN_TAG_PID = "eagle3/cli_pid"
RUN_TAG_HOST = "eagle3/cli_host"
R = TypeVar("R")
# Steps run inside the CLI's process (`execute_in_process`: no per-step interpreter start-up, the
# listener is an object of this process); the UI re-executes the same jobs with their default executor.
RUN_CONFIG = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


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


def _root(error: Any) -> Any:
    while error.cause is not None:
        error = error.cause
    return error


def _root_message(error: Any) -> str:
    return _root(error).message.strip()


class RunFailed(RuntimeError):
    """A run of the main job failed; ``error_class`` is the class name of the first failed step's root error."""

    def __init__(self, message: str, error_class: str | None) -> None:
        super().__init__(message)
        self.error_class = error_class


def root_error_class(events: Sequence[Any]) -> str | None:
    """The class name of the root error of the run's first failed step, None if no step failed with one."""
    for event in events:
        if event.is_step_failure and event.step_failure_data.error is not None:
            return _root(event.step_failure_data.error).cls_name
    return None


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
            raise RunFailed(
                f"run {result.run_id} of {job_name} failed: {failure_detail(result.all_events)}\n"
                f"  error, traceback and logs: run {result.run_id} in the Dagster UI "
                f"(DAGSTER_HOME={os.environ.get('DAGSTER_HOME', '')} dagster dev)",
                root_error_class(result.all_events),
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
        from eagle3_pipeline.hidden_states.draft_vocab import DraftVocabResult

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
        from eagle3_pipeline.drafter.evaluate.results import summary_table

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


def cmd_run(args: argparse.Namespace) -> int:
    config = load_or_report(args)
    if config is None:
        return ExitCode.BAD_INPUT
    print(f"artifacts: {config.artifacts_root}", flush=True)
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
    except RunFailed as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return HOST_ERROR_CODES.get(exc.error_class or "", ExitCode.UNHEALTHY)
    return ExitCode.OK
