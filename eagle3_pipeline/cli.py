"""`eagle3-pipeline …`: run the main job on a Dagster instance, or show the pipeline's status."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
import warnings
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import CONFIG_ENV_VAR, ConfigError, PipelineConfig, load_config
from eagle3_pipeline.generation import CheckpointError, Progress
from eagle3_pipeline.monitor import HealthMonitor
from eagle3_pipeline.status import RunInFlight, dataset_progress, exit_code, extraction_status, render_status, status_document

RUN_TAG_PID = "eagle3/cli_pid"
RUN_TAG_HOST = "eagle3/cli_host"
DEFAULT_DAGSTER_HOME = ".dagster_home"


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
    concurrency slots, so the `gpu` pool is not held by a dead process."""
    from dagster import DagsterRunStatus, RunsFilter

    unfinished = [DagsterRunStatus.STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.NOT_STARTED]
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


def failure_detail(events: Sequence[Any]) -> str:
    """Why a run failed, in a line or two: the failed checks' verdicts, else the step's error."""
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
    return data.error.message.strip() if data.error else f"step {failure.step_key} failed"


class MainJob:
    """Materialize every asset and partition in dependency order, one Dagster run per step."""

    def __init__(self, config: PipelineConfig, instance: Any, out: Any = sys.stdout) -> None:
        from eagle3_pipeline.defs.definitions import build_definitions
        from eagle3_pipeline.serving import InferenceProvider

        self.config = config
        self.instance = instance
        self.out = out
        self.defs = build_definitions(config)
        self.bar = ProgressBar(out) if out.isatty() else None
        self.provider = InferenceProvider(config, progress=self.bar)
        self.tags = {RUN_TAG_PID: str(os.getpid()), RUN_TAG_HOST: socket.gethostname(), "eagle3/entry": "cli"}
        self.results: dict[str, dict[str, Any]] = {}

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.end_line()
        print(text, file=self.out, flush=True)

    def _materialize(self, selection: Sequence[str], partition_key: str | None = None) -> Any:
        import dagster as dg

        assets = list(self.defs.assets or [])
        resources_ = {"inference": self.provider, "pipes_subprocess_client": dg.PipesSubprocessClient()}
        result = dg.materialize(
            assets,
            selection=list(selection),
            partition_key=partition_key,
            instance=self.instance,
            resources=resources_,
            tags=self.tags,
            raise_on_error=False,
            run_config={"loggers": {"console": {"config": {"log_level": "INFO"}}}},
        )
        if not result.success:
            raise RuntimeError(f"run {result.run_id} failed: {failure_detail(result.all_events)}")
        for event in result.get_asset_materialization_events():
            mat = event.step_materialization_data.materialization
            key = mat.asset_key.to_user_string() + (f"[{mat.partition}]" if mat.partition else "")
            self.results[key] = {k: v.value for k, v in mat.metadata.items()}
        return result

    def run(self) -> None:
        started = time.monotonic()
        try:
            if self.config.inference.kind == "embedded":
                self.say("» target_model: preparing the embedded model")
                self._materialize(["target_model"])
            for dataset_id in self.config.dataset_ids:
                self.say(f"» prompts + responses [{dataset_id}]")
                self._materialize(["prompts", "responses"], partition_key=dataset_id)
            self.say("» training_data")
            self._materialize(["training_data"])
            self.say("» draft_vocab")
            self._materialize(["draft_vocab"])
            self.say("» hidden_states")
            self._materialize(["hidden_states"])
        finally:
            self.provider.close()
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
        ]


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
    monitor = HealthMonitor(config)
    try:
        report, _ = monitor.tick()
    finally:
        monitor.close()
    try:
        progress = dataset_progress(config)
    except CheckpointError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status_document(report, progress), indent=2))
    else:
        print(render_status(report, progress, runs_in_flight(), extraction_status(config)))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-pipeline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="materialize every asset and partition (the main job)")
    run.add_argument("--config", help=f"pipeline file (default: ${CONFIG_ENV_VAR} or the shipped local profile)")
    run.set_defaults(func=cmd_run)
    status = sub.add_parser("status", help="health checks, per-dataset progress and runs in flight")
    status.add_argument("--config", help=f"pipeline file (default: ${CONFIG_ENV_VAR} or the shipped local profile)")
    status.add_argument("--json", action="store_true", help="print {overall, checks, datasets} as JSON")
    status.set_defaults(func=cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
