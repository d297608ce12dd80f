"""`eagle3-pipeline plan`: per dataset and backend the ETA and cost, τ expected from more data, the hidden
states' disk and the schedule on the GPU host."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import TYPE_CHECKING

from eagle3_pipeline.cli.errors import ExitCode, fail
from eagle3_pipeline.cli.shared import load_or_report
from eagle3_pipeline.config import ConfigError
from eagle3_pipeline.generation import CheckpointError
from eagle3_pipeline.generation.progress import format_duration
from eagle3_pipeline.layout import ArtifactLayout

if TYPE_CHECKING:
    from eagle3_pipeline.cli.schedule import Schedule
    from eagle3_pipeline.fit.records import FitReport


def with_fit_times(schedule: Schedule, fit: FitReport | str) -> Schedule:
    """The schedule with the resource model's time figure (labelled) where it had none."""
    if isinstance(fit, str):
        return schedule
    steps = []
    for step in schedule.steps:
        phase = fit.phase(step.phase.split(" ")[0])
        if step.gpu and step.gpu_time_s is None and phase is not None and phase.time_s is not None:
            step = replace(step, gpu_time_s=phase.time_s, basis=phase.time_basis)
        steps.append(step)
    gpu = [step for step in steps if step.gpu]
    missing = [step.phase for step in gpu if step.gpu_time_s is None]
    total = format_duration(sum(step.gpu_time_s or 0.0 for step in gpu))
    known = f"GPU time known: {total}" + (f"; UNKNOWN for {', '.join(missing)}" if missing else "")
    notes = [known if note.startswith("GPU time known") else note for note in schedule.notes]
    return replace(schedule, steps=steps, notes=notes)


def cmd_plan(args: argparse.Namespace) -> int:
    # The plan reads the artifacts, not the sources: a box whose prompt files are elsewhere plans too
    # (a calibration's endpoints check their keys themselves).
    config = load_or_report(args, runtime_checks=False)
    if config is None:
        return ExitCode.BAD_INPUT
    from eagle3_pipeline.cli.schedule import serving_schedule
    from eagle3_pipeline.drafter.evaluate.scaling import data_scaling
    from eagle3_pipeline.generation.planning import build_plan, calibrate, checkpoint_records, throughput_evidence
    from eagle3_pipeline.hidden_states.disk import config_disk_plan

    try:
        records = checkpoint_records(ArtifactLayout(config.artifacts_root), config.dataset_ids)
    except CheckpointError as exc:
        return fail(str(exc), ExitCode.UNHEALTHY)
    throughput = throughput_evidence(config.inference, config.target.model, records)
    failed: dict[str, str] = {}
    if args.calibrate:
        from eagle3_pipeline.inference.provider import InferenceProvider, endpoints_from_config

        provider = InferenceProvider(config)
        try:
            endpoints = provider.endpoints() if provider.embedded else endpoints_from_config(config)
            measured, failed = calibrate(config, endpoints, args.calibrate)
        except (ConfigError, RuntimeError) as exc:
            return fail(f"calibration impossible: {exc}", ExitCode.UNHEALTHY)
        finally:
            provider.close()
        throughput = {name: measured.get(name) or throughput.get(name) for name in throughput}
    plan = build_plan(config, throughput, records, args.max_cost)
    scaling = data_scaling(
        config.artifacts_root, config.inference, config.target.model, config.dataset_ids, records, throughput
    )
    disk = config_disk_plan(config, records, {d: (w.prompt_left, w.completion_left) for d, w in plan.workloads.items()})
    schedule = serving_schedule(config, plan, records)
    from eagle3_pipeline.fit.runtime import declared_machine, report_for

    fit = report_for(config, declared_machine(config))
    schedule = with_fit_times(schedule, fit)
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
                    "fit": fit if isinstance(fit, str) else fit.as_dict(),
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
        print("\n" + (fit if isinstance(fit, str) else fit.text()))
        print("\n" + schedule.text())
        print(f"\nartifacts: {config.artifacts_root}")
    return ExitCode.OK
