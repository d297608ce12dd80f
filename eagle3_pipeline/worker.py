"""The entry point a heavy phase runs on a GPU host: ``python -m eagle3_pipeline.worker PHASE --spec FILE``.

Loads the JSON spec, runs the phase named in :data:`eagle3_pipeline.compute.PHASES` with a
reporter, and hands back its metadata:

- launched under Dagster Pipes (the orchestrator's ``compute: ssh`` sets ``DAGSTER_PIPES_CONTEXT``
  and ``DAGSTER_PIPES_MESSAGES``): log lines and progress (a log line plus a custom message the
  orchestrator records as an asset observation) and the final metadata
  (``report_asset_materialization``) go through ``dagster_pipes``; an exception is reported to
  the run before the worker exits non-zero;
- otherwise: log and progress lines on stderr, the metadata as one JSON line on stdout;
- under ``torchrun`` (``RANK`` set, see :func:`eagle3_pipeline.compute.worker_argv`) only rank 0
  reports as above; the other ranks run the phase silently (an error still ends them non-zero
  with its traceback on stderr, and torchrun then stops the launch). torchrun starts each rank
  in a session of its own, so a rank asks the kernel to kill it when its launcher dies: a
  ``kill -9`` of the launch (or of the host run's process group) leaves no rank training on.

It imports ``dagster_pipes`` only, never ``dagster``: the GPU host needs no Dagster.
SIGTERM ends it with exit status 143 after the phase's cleanup (``finally`` blocks) ran.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from dagster_pipes import PipesContext, PipesEnvVarParamsLoader, open_dagster_pipes

from eagle3_pipeline.compute import PHASES, UnknownPhase, phase_function

PROGRESS_MESSAGE = "eagle3.progress"
TERMINATED = 143


class SpecError(ValueError):
    """The spec file is missing or not a JSON object."""


class Terminated(Exception):
    """SIGTERM arrived: the phase unwinds (its ``finally`` blocks run), then the worker exits 143."""


def load_spec(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{path}: spec file does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"{path}: not a JSON spec ({type(exc).__name__}: {exc})") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _progress_text(metrics: Mapping[str, float | int | str]) -> str:
    return "progress: " + ", ".join(f"{key}={value}" for key, value in metrics.items())


class PipesReporter:
    """Reports through Dagster Pipes: logs as Pipes log messages, progress as a log line and a
    custom message ``{"type": "eagle3.progress", "metrics": {...}}``."""

    def __init__(self, pipes: PipesContext) -> None:
        self._pipes = pipes

    def log(self, message: str) -> None:
        self._pipes.log.info(message)

    def progress(self, metrics: Mapping[str, float | int | str]) -> None:
        self._pipes.log.info(_progress_text(metrics))
        self._pipes.report_custom_message({"type": PROGRESS_MESSAGE, "metrics": dict(metrics)})


class StderrReporter:
    """Reports as timestamped lines on stderr (a worker run by hand)."""

    def log(self, message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)

    def progress(self, metrics: Mapping[str, float | int | str]) -> None:
        self.log(_progress_text(metrics))


class SilentReporter:
    """A torchrun rank other than 0: rank 0 speaks for the launch."""

    def log(self, message: str) -> None:
        return None

    def progress(self, metrics: Mapping[str, float | int | str]) -> None:
        return None


def pipes_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A phase's metadata as Pipes takes it: dicts and lists (a phase's config, its training
    curve) travel as ``json`` values, which the orchestrator reads back as the same objects."""
    return {
        key: {"raw_value": value, "type": "json"} if isinstance(value, (dict, list)) else value
        for key, value in metadata.items()
    }


def _die_with_launcher() -> None:
    """Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``; a launcher already gone ends this rank now."""
    import ctypes

    launcher = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1 = PR_SET_PDEATHSIG
        print(f"warning: cannot tie this rank to its launcher (errno {ctypes.get_errno()})", file=sys.stderr)
    if os.getppid() != launcher:
        os._exit(TERMINATED)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated("terminated by SIGTERM")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_pipeline.worker", description="Run one heavy phase.")
    parser.add_argument("phase", help=f"one of {', '.join(sorted(PHASES))}")
    parser.add_argument("--spec", required=True, type=Path, help="the phase's JSON spec (paths on this machine)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if "RANK" in os.environ and sys.platform == "linux":
        _die_with_launcher()
    try:
        function = phase_function(args.phase)
        spec = load_spec(args.spec)
    except (UnknownPhase, SpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if int(os.environ.get("RANK", "0")) != 0:
            function(spec, SilentReporter())
        elif PipesEnvVarParamsLoader().is_dagster_pipes_process():
            with open_dagster_pipes() as pipes:
                metadata = function(spec, PipesReporter(pipes))
                pipes.report_asset_materialization(metadata=pipes_metadata(metadata))
        else:
            metadata = function(spec, StderrReporter())
            print(json.dumps(metadata), flush=True)
    except Terminated:
        print("worker terminated by SIGTERM", file=sys.stderr)
        return TERMINATED
    return 0


if __name__ == "__main__":
    sys.exit(main())
