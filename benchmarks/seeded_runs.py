"""What the drafter benchmarks that compare settings across seeds share: one run of the train phase (read
back from its ``.json`` in the work folder when it finished before, so a rerun trains nothing again) with its
last and best eval, and the mean ± sd cell of their tables."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.tau_scaling import Log  # the same quiet reporter as the τ-scaling benchmark
from eagle3_pipeline.drafter.train.phase import run


def trained_run(work: Path, name: str, spec: dict[str, Any], select_steps: int, /, **fields: Any) -> dict[str, Any]:
    """``fields`` and the run's steps, wall time, start eval (a warm start's, else None), last eval and best
    eval by τ@``select_steps`` (the latest of equals), saved as ``work/name.json``."""
    saved = work / f"{name}.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    started = time.monotonic()
    result = run(spec, Log(name))
    key = f"tau@{select_steps}"
    evals = [e for e in result["evals"] if key in e]
    best = max(reversed(evals), key=lambda e: e[key])
    row = {**fields, "steps": result["steps"], "wall_s": round(time.monotonic() - started),
           "start": result.get("start"), "last": evals[-1], "best": best}  # fmt: skip
    saved.write_text(json.dumps(row, indent=1))
    return row


def mean_sd(values: list[float]) -> str:
    """The value, or mean ± sd over the seeds (the sd of the seeds, not of the mean); "—" for none."""
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"
