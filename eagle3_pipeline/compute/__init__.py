"""Where a heavy phase runs. A phase is a plain function ``run(spec, report) -> metadata`` in its
domain module, named in :data:`PHASES`; ``local`` calls it in this process, ``ssh`` and ``command``
run ``python -m eagle3_pipeline.worker PHASE --spec FILE`` on the GPU host.

The spec is a JSON-able dict whose paths are paths on the machine where the phase runs; the
returned dict (JSON-able) becomes the materialization's metadata.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

PHASES: Mapping[str, str] = {
    "extract": "eagle3_pipeline.hidden_states.extract:run",
    "import-specforge": "eagle3_pipeline.hidden_states.importer:run",
    "train": "eagle3_pipeline.drafter.train.phase:run",
    "evaluate": "eagle3_pipeline.drafter.evaluate.phase:run",
}


class Reporter(Protocol):
    """How a running phase talks back: log lines, and progress points (an observation in Dagster)."""

    def log(self, message: str) -> None: ...

    def progress(self, metrics: Mapping[str, float | int | str]) -> None: ...


PhaseFunction = Callable[[dict[str, Any], Reporter], dict[str, Any]]


class UnknownPhase(ValueError):
    """A phase name that is not in :data:`PHASES`."""


def phase_function(phase: str) -> PhaseFunction:
    if phase not in PHASES:
        raise UnknownPhase(f"unknown phase {phase!r}; expected one of {', '.join(sorted(PHASES))}")
    module, _, name = PHASES[phase].partition(":")
    function: PhaseFunction = getattr(importlib.import_module(module), name)
    return function


def run_local(phase: str, spec: dict[str, Any], report: Reporter) -> dict[str, Any]:
    """Run a phase in this process (``compute: local``)."""
    return phase_function(phase)(spec, report)


def worker_argv(phase: str, spec: str, python: str = sys.executable, processes: int = 1) -> list[str]:
    """How a worker starts: ``PYTHON -m eagle3_pipeline.worker PHASE --spec SPEC``; with ``processes``
    > 1 the same module under torchrun (``PYTHON -m torch.distributed.run --standalone
    --nproc_per_node N``: N ranks on this machine, rendezvous on a free local port)."""
    entry = ["-m", "eagle3_pipeline.worker", phase, "--spec", spec]
    if processes > 1:
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), *entry]
    return [python, *entry]


def resolve_processes(setting: int | Literal["auto"], gpus: int) -> int:
    """``auto``: one process per GPU the machine reports, 1 when it reports none."""
    return max(1, gpus) if setting == "auto" else int(setting)


def local_gpu_count() -> int:
    """The CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
