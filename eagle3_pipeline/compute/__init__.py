"""Where a heavy phase runs. A phase is a plain function ``run(spec, report) -> metadata`` in its
domain module, named in :data:`PHASES`; ``local`` calls it in this process, ``ssh`` and ``command``
run ``python -m eagle3_pipeline.worker PHASE --spec FILE`` on the GPU host.

The spec is a JSON-able dict whose paths are paths on the machine where the phase runs; the
returned dict (JSON-able) becomes the materialization's metadata.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

PHASES: Mapping[str, str] = {
    "extract": "eagle3_pipeline.hidden_states.extract:run",
    "import-specforge": "eagle3_pipeline.hidden_states.importer:run",
    "train": "eagle3_pipeline.drafter.train:run",
    "evaluate": "eagle3_pipeline.drafter.evaluate:run",
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
