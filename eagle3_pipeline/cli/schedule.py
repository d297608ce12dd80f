"""The main job's schedule on the GPU host, as `eagle3-pipeline plan` prints it: each phase in order, what the
managed server does before it (which role starts or stops) and who holds the GPUs during it, and the GPU time
of the phase with what that figure is based on — UNKNOWN where the project has no basis, never a guess.

The phases and the server's transition before each are the table's (eagle3_pipeline.config.phases), the rules the
phases apply at run time (eagle3_pipeline.components.managed): a phase hands over the managed server of its own
machine as its row's ``handover`` says (:func:`server_before`); a managed vLLM server is the extraction server of
``hidden_states.backend: vllm``; after a GPU phase the generation server comes back while ``responses``
partitions are incomplete.

The GPU time of each phase and its basis:
- ``responses``: the planner's ETA on the managed server's endpoint (tokens left over the throughput its
  answers showed, or a calibration: eagle3_pipeline.generation.planning);
- ``hidden_states``: the tokens to extract (training_data's manifest, or the planner's estimate of it:
  eagle3_pipeline.hidden_states.disk.training_tokens) over the extraction rate an earlier extraction into the
  store recorded (its ``result.json`` here);
- ``drafter_benchmark``: the arms' wall time the last benchmark recorded, every concurrency of each (start-ups
  not included);
- training, evaluation and the served drafter: no rate is recorded where this command runs: UNKNOWN.
Each server start is bounded by ``serving.startup_timeout_s``; its measured duration is on every start's
observation of ``inference_server``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from eagle3_pipeline.config import ComputeConfig, HiddenStatesConfig, PipelineConfig
from eagle3_pipeline.config.phases import PHASES, GpuPhase, Handover
from eagle3_pipeline.generation.planning import Plan
from eagle3_pipeline.generation.progress import format_duration
from eagle3_pipeline.hidden_states.disk import training_tokens
from eagle3_pipeline.hidden_states.resume import RESULT_FILE, recorded_rate
from eagle3_pipeline.hidden_states.vllm_server import managed_extraction_server
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed import ServerSetup, managed_server
from eagle3_pipeline.managed.phases import gpu_phase_server, incomplete_partitions

UNKNOWN = "UNKNOWN"
NO_GPU = "runs on this machine, no GPU"


@dataclass(frozen=True)
class Step:
    """One phase of the schedule; ``gpu``: the phase itself uses the GPUs (generation: the server's)."""

    phase: str
    server: str  # what the managed server does before the phase
    gpus: str  # who holds the GPUs during it
    gpu_time_s: float | None
    basis: str
    gpu: bool = False

    @property
    def gpu_time(self) -> str:
        if not self.gpu:
            return "none"
        return UNKNOWN if self.gpu_time_s is None else format_duration(self.gpu_time_s)


@dataclass(frozen=True)
class Schedule:
    heading: str
    steps: list[Step]
    notes: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {
            "heading": self.heading,
            "steps": [{**asdict(step), "gpu_time": step.gpu_time} for step in self.steps],
            "notes": self.notes,
        }

    def text(self) -> str:
        rows = [["phase", "server before it", "GPUs held by", "GPU time", "based on"]]
        rows += [[s.phase, s.server, s.gpus, s.gpu_time, s.basis] for s in self.steps]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [self.heading, ""]
        lines += ["  ".join([*(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)), row[4]]) for row in rows]
        return "\n".join([*lines, "", *self.notes])


def _generation_time(plan: Plan, server: ServerSetup | None) -> tuple[float | None, str]:
    """The planner's ETA of every dataset on the managed server's endpoint (or, unmanaged, on the best backend)."""
    url = server.base_url.rstrip("/") if server is not None else None
    total = 0.0
    for dataset, work in plan.workloads.items():
        rows = [r for r in plan.rows if r.dataset == dataset]
        row = next((r for r in rows if url is not None and r.backend.base_url.rstrip("/") == url), None)
        if row is None:
            row = next((r for r in rows if r.backend.name == plan.best.get(dataset)), None)
        if work.completion_left == 0:
            continue
        if row is None or row.eta_s is None:
            where = "the managed endpoint" if server is not None else "any backend"
            name = row.backend.name if row is not None else where
            return None, f"no measured throughput of {name} for {dataset} (`plan --calibrate N`, or answers so far)"
        total += row.eta_s
    if all(work.completion_left == 0 for work in plan.workloads.values()):
        return 0.0, "the planner: nothing left to generate"
    return total, "the planner: tokens left / tokens/s of the answers so far or a calibration (table above)"


def _extraction_time(
    layout: ArtifactLayout, records: dict[str, dict[str, dict[str, Any]]], plan: Plan
) -> tuple[float | None, str]:
    left = {d: (w.prompt_left, w.completion_left) for d, w in plan.workloads.items()}
    tokens = training_tokens(layout.training_data, records, left)
    if isinstance(tokens, str):
        return None, tokens
    rate = recorded_rate(layout.hidden_states)
    if rate is None:
        return (
            None,
            f"{tokens[0]:,} tokens to extract, but no extraction rate recorded here (hidden_states/{RESULT_FILE})",
        )
    return tokens[0] / rate, f"{tokens[0]:,} tokens / {rate:,.0f} tokens/s of the last extraction into the store"


def _benchmark_time(layout: ArtifactLayout) -> tuple[float | None, str]:
    try:
        result = json.loads(layout.drafter_benchmark.read_text())["result"]
        wall = sum(float(level["wall_s"]) for arm in result["arms"] for level in arm["levels"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, "no benchmark recorded here (drafter_benchmark.json)"
    return wall, "the arms' wall time of the last benchmark (server start-ups not included)"


def serving_schedule(config: PipelineConfig, plan: Plan, records: dict[str, dict[str, dict[str, Any]]]) -> Schedule:
    """The schedule of the main job (module doc), which generates every partition before the phases after
    ``responses``: the server's state is followed from phase to phase."""
    server = managed_server(config)
    if server is None:
        heading = "schedule: the inference server is the user's (serving.managed is false); the pipeline runs none"
    else:
        heading = (
            f"schedule on {server.host.hostname or 'this machine'}: the managed {server.engine} server "
            f"({server.setting}, port {server.port}, TP {server.serving.tp_size}), in the main job's order"
        )
    generation_s, generation_basis = _generation_time(plan, server)
    responses, *after = PHASES
    start, held = server_before(responses.handover, None, server is not None)
    serving = held or "the user's server"
    steps = [
        Step(f"responses ×{len(config.dataset_ids)}", start, serving, generation_s, generation_basis, gpu=True),
        Step("training_data", "—", f"{serving} (its /tokenize check)", None, NO_GPU),
        Step("draft_vocab", "—", serving, None, NO_GPU),
    ]
    state = "generation" if server else None  # the managed server's role as the main job goes
    extraction = managed_extraction_server(config) is not None
    k = config.drafter_benchmark.steps if config.drafter_benchmark else 0
    for row in after:
        phase = row.phase
        if phase == "drafter_benchmark" and config.drafter_benchmark is None:
            continue
        if phase == "served_drafter" and (server is None or not server.serving.serve_drafter):
            continue
        shared = gpu_phase_server(config, phase) is not None
        before, held = server_before(row.handover, state, shared, extraction, k)
        holder = held or _holder(config.compute, config.hidden_states, phase)
        if held or shared:
            state = None
        if phase == "hidden_states":
            seconds, basis = _extraction_time(ArtifactLayout(config.artifacts_root), records, plan)
        elif phase == "drafter_benchmark":
            seconds, basis = _benchmark_time(ArtifactLayout(config.artifacts_root))
        elif phase == "served_drafter":
            seconds, basis = None, "one server start and a few eval prompts; no rate recorded"
        else:
            seconds, basis = None, "no training or evaluation rate is recorded where this command runs"
        steps.append(Step(phase, before, holder, seconds, basis, gpu=True))
    notes = []
    if server is not None:
        settings = server.serving
        incomplete = incomplete_partitions(config)
        notes += [
            "a GPU phase run on its own while responses partitions are incomplete "
            f"({len(incomplete)} now) brings the generation server back after it",
            f"each server start: at most serving.startup_timeout_s = {settings.startup_timeout_s:g} s "
            "(the measured durations are on inference_server's observations); each stop: at most "
            f"stop_grace_s + gpu_release_timeout_s = {settings.stop_grace_s + settings.gpu_release_timeout_s:g} s",
        ]
    gpu = [step for step in steps if step.gpu]
    total = sum(step.gpu_time_s or 0.0 for step in gpu)
    missing = [step.phase for step in gpu if step.gpu_time_s is None]
    notes.append(
        f"GPU time known: {format_duration(total)}" + (f"; UNKNOWN for {', '.join(missing)}" if missing else "")
    )
    return Schedule(heading, steps, notes)


def server_before(
    handover: Handover, state: str | None, shared: bool, extraction: bool = False, steps: int = 0
) -> tuple[str, str | None]:
    """What the managed server does before a phase whose row's hand-over is ``handover``, and the managed server
    that holds the GPUs during it (None: none of ours, the phase's own process or the user's server).
    ``state``: the role the server serves (None: stopped); ``shared``: a managed server runs on the phase's
    machine; ``extraction``: a managed server is the extraction server (``purpose``); ``steps``: the
    benchmark drafter's K (``arms``)."""
    if handover == "serves":
        return ("start generation", "generation server") if shared else ("—", None)
    if handover == "keeps":
        return (
            "start served-drafter if its τ beats the served one's (else the served one again)",
            "served-drafter server",
        )
    if handover == "purpose" and extraction:
        return f"{_stop(state)}start extraction (the store's layer ids)", "extraction server"
    if not shared:
        return "— (no managed server on its machine)", None
    if handover == "arms":
        return f"{_stop(state)}start baseline, then with the drafter (K={steps}); stop", "benchmark servers"
    return (f"stop {state} (verified)" if state else "— (stopped)"), None


def _stop(state: str | None) -> str:
    return f"stop {state}, " if state else ""


def _holder(compute: ComputeConfig, hidden_states: HiddenStatesConfig, phase: GpuPhase) -> str:
    where = "this machine" if compute.kind == "local" else f"{compute.host.hostname}"
    if phase == "hidden_states":
        backend = hidden_states.backend
        ranks = f", TP {hidden_states.tp_size}" if backend == "sglang" else ""
        return f"hidden_states ({backend}{ranks}) on {where}"
    return f"{phase} on {where}"
