"""The one table of the phases that use GPUs: which machine's GPUs, what the managed server
does for the phase (its hand-over), and whether the step joins the `gpu` pool. The run-time hand-overs
(eagle3_pipeline.components.managed), `plan`'s schedule (eagle3_pipeline.cli.schedule), the step
policy (eagle3_pipeline.components.policy, orchestration/step_tags.py) and the resource model
(eagle3_pipeline.fit) all read it; no other module lists the GPU phases.

Rows are in the main job's order. The fields:

- ``machine``: ``server`` — the health host, the managed server's own (generation, the benchmark's arms,
  the served drafter); ``compute`` — where ``compute:`` runs heavy phases (this machine or ``compute.host``).
- ``handover``: what the managed server on the phase's machine does — ``serves`` (it is the phase's server:
  generation), ``stops`` (stopped, verified, for the phase; the generation server comes back after it while
  ``responses`` partitions are incomplete), ``purpose`` (it serves the phase's own launch line: the
  extraction server when the backend is vllm, else it stops), ``arms`` (it serves the benchmark's baseline,
  then the drafter; stopped after), ``keeps`` (nothing is handed over: the served drafter replaces the
  served one itself).
- ``heavy``: dispatched through ``compute:`` (local, ssh or command), so its own process needs GPUs only under
  ``compute.kind: local``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

GpuPhase = Literal[
    "responses", "hidden_states", "eagle3_drafter", "drafter_eval", "drafter_benchmark", "served_drafter"
]
Machine = Literal["server", "compute"]
Handover = Literal["serves", "stops", "purpose", "arms", "keeps"]


@dataclass(frozen=True)
class PhaseRow:
    phase: GpuPhase
    machine: Machine
    handover: Handover
    heavy: bool


PHASES: tuple[PhaseRow, ...] = (
    PhaseRow("responses", "server", "serves", heavy=False),
    PhaseRow("hidden_states", "compute", "purpose", heavy=True),
    PhaseRow("eagle3_drafter", "compute", "stops", heavy=True),
    PhaseRow("drafter_eval", "compute", "stops", heavy=True),
    PhaseRow("drafter_benchmark", "server", "arms", heavy=False),
    PhaseRow("served_drafter", "server", "keeps", heavy=False),
)
GPU_PHASES: tuple[GpuPhase, ...] = tuple(row.phase for row in PHASES)
HEAVY_PHASES: tuple[GpuPhase, ...] = tuple(row.phase for row in PHASES if row.heavy)
assert GPU_PHASES == get_args(GpuPhase), "PHASES must list every GpuPhase once, in the main job's order"


def phase_row(phase: str) -> PhaseRow:
    """The row of ``phase``; KeyError for an asset that uses no GPU."""
    for row in PHASES:
        if row.phase == phase:
            return row
    raise KeyError(phase)
