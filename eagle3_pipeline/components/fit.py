"""The resource model in a run (eagle3_pipeline.fit): before a GPU phase's work, the machine is read on the
phase's host, every phase's fit is logged, a phase that cannot fit fails the step with the figures (before
generation: any later phase that cannot fit, under `machine.check: before_generation`), and the phase goes on
with the file's `auto` settings chosen."""

from __future__ import annotations

from typing import Any

import dagster as dg

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.config.phases import GpuPhase
from eagle3_pipeline.fit.runtime import phase_machine, refusal, report_for, resolved


def fitted(context: Any, config: PipelineConfig, phase: GpuPhase) -> PipelineConfig:
    """``config`` with its ``auto`` settings chosen for ``phase``'s machine; dg.Failure when it cannot fit."""
    if config.machine.check == "off" and not _has_auto(config):
        return config
    report = report_for(config, phase_machine(config, phase))
    context.log.info(report if isinstance(report, str) else report.text())
    refused = refusal(config, report, phase)
    if refused is not None:
        raise dg.Failure(description=refused)
    return resolved(config, report)


def _has_auto(config: PipelineConfig) -> bool:
    hs = config.hidden_states
    return "auto" in (
        hs.batch_tokens,
        hs.mem_fraction_static,
        hs.rolling_window_shards,
        config.drafter.activation_checkpointing,
    )
