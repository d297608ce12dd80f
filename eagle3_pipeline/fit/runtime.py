"""The resource model for a pipeline file: its target's checkpoint found on this machine, the machine of a
phase (declared, and read live on its host at a phase's preflight), the tokens the phases will handle, and
the file with the ``auto`` settings the model chose (:func:`resolved`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.config.phases import GpuPhase
from eagle3_pipeline.fit.checkpoint import CheckpointError, read_weights
from eagle3_pipeline.fit.machine import Machine, combined, declared, live
from eagle3_pipeline.fit.records import FitReport, Workload, workload_from_budgets
from eagle3_pipeline.fit.report import fit_report as build_report
from eagle3_pipeline.hidden_states.disk import local_target_folder
from eagle3_pipeline.hidden_states.resume import RESULT_FILE, recorded_rate
from eagle3_pipeline.hidden_states.sharding import ROLLING_LAYOUT_FILE
from eagle3_pipeline.layout import ArtifactLayout

# What an ``auto`` setting becomes when the model could not choose (the GPU's memory unknown).
AUTO_FALLBACK = {"batch_tokens": 8192, "activation_checkpointing": False}


def declared_machine(config: PipelineConfig) -> Machine:
    gpus = config.compute.gpus if config.compute.kind != "local" else None
    return declared(config.machine, gpus or config.serving.tp_size)


def phase_machine(config: PipelineConfig, phase: GpuPhase) -> Machine:
    """The machine of ``phase`` (config/phases.py ``machine``), read live on it, the declaration filling gaps."""
    from eagle3_pipeline.hosts import build_host
    from eagle3_pipeline.managed.phases import phase_host

    host_config = phase_host(config.compute, config.health, phase)
    where = host_config.hostname or "this machine"
    root = config.compute.artifacts_root if config.compute.kind != "local" else None
    with build_host(host_config) as host:
        found = live(host, str(root or config.artifacts_root), where)
    return combined(found, declared_machine(config))


def workload(config: PipelineConfig) -> Workload:
    """training_data's token count when it exists, else the datasets' token budgets."""
    manifest = ArtifactLayout(config.artifacts_root).training_data / "manifest.json"
    try:
        tokens = json.loads(manifest.read_text()).get("tokens")
    except (OSError, ValueError):
        tokens = None
    if isinstance(tokens, int):
        return Workload(tokens, 0, f"{manifest}")
    return workload_from_budgets(config)


def report_for(config: PipelineConfig, machine: Machine) -> FitReport | str:
    """The fit of every GPU phase on ``machine``, or the sentence saying why it cannot be made here."""
    found = local_target_folder(config.hidden_states, config.target, config.inference)
    if isinstance(found, str):
        return f"fit: {found}"
    raw, folder = found
    try:
        weights = read_weights(Path(folder), raw)
        return build_report(
            config,
            raw,
            weights,
            machine,
            workload(config),
            recorded_rate(ArtifactLayout(config.artifacts_root).hidden_states),
        )
    except (CheckpointError, ValueError, KeyError) as exc:
        return f"fit: unknown: {folder}: {exc}"


def resolved(config: PipelineConfig, report: FitReport | str) -> PipelineConfig:
    """``config`` with each ``auto`` setting the report chose (the fallback where it could not)."""
    chosen: dict[str, Any] = {}
    if not isinstance(report, str):
        chosen = {choice.setting: choice.value for choice in report.choices}
    hidden: dict[str, Any] = {}
    if config.hidden_states.batch_tokens == "auto":
        hidden["batch_tokens"] = chosen.get("hidden_states.batch_tokens", AUTO_FALLBACK["batch_tokens"])
    if config.hidden_states.mem_fraction_static == "auto" and "hidden_states.mem_fraction_static" in chosen:
        hidden["mem_fraction_static"] = chosen["hidden_states.mem_fraction_static"]
    if config.hidden_states.rolling_window_shards == "auto":
        hidden["rolling_window_shards"] = _rolling_as_extracted(config, chosen)
    drafter: dict[str, Any] = {}
    if config.drafter.activation_checkpointing == "auto":
        drafter["activation_checkpointing"] = chosen.get(
            "drafter.activation_checkpointing", AUTO_FALLBACK["activation_checkpointing"]
        )
    return config.model_copy(
        update={
            "hidden_states": config.hidden_states.model_copy(update=hidden),
            "drafter": config.drafter.model_copy(update=drafter),
        }
    )


def _rolling_as_extracted(config: PipelineConfig, chosen: Mapping[str, Any]) -> int | None:
    """rolling_window_shards auto: the window of the store already extracted (its rolling layout), off for a whole
    store already extracted, else the model's choice (off when it could not choose)."""
    store = ArtifactLayout(config.artifacts_root).hidden_states
    try:
        return int(json.loads((store / ROLLING_LAYOUT_FILE).read_text())["window_shards"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if (store / RESULT_FILE).is_file():
        return None
    value = chosen.get("hidden_states.rolling_window_shards")
    return value if isinstance(value, int) else None


def refusal(config: PipelineConfig, report: FitReport | str, phase: GpuPhase) -> str | None:
    """Why ``phase`` must not start (None: it may), under ``machine.check``: before generation every later
    phase is checked, at another phase its own row; an UNKNOWN figure is reported, never refused."""
    if isinstance(report, str) or config.machine.check == "off":
        return None
    if phase == "responses" and config.machine.check == "before_generation":
        unfit = report.unfit()
    else:
        row = report.phase(phase)
        unfit = [row] if row is not None and row.verdict == "does not fit" else []
    if phase == "hidden_states" and config.hidden_states.mem_fraction_static == "auto":
        if report.machine.gpu_bytes is None and config.hidden_states.backend == "sglang":
            return (
                "hidden_states: mem_fraction_static is auto but the GPUs' memory is unknown "
                f"({report.machine.source}): set hidden_states.mem_fraction_static or machine.gpu"
            )
    if not unfit:
        return None
    lead = (
        "generation is not started: a later phase cannot fit this machine "
        "(machine.check: per_phase runs the phases that fit)"
        if phase == "responses"
        else f"{phase} cannot fit this machine"
    )
    return f"{lead} — " + " | ".join(p.refusal() for p in unfit) + f" [{report.machine.describe()}]"
