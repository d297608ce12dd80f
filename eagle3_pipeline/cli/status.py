"""`eagle3-pipeline status`: the health report, per-dataset progress and the runs in flight."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle3_pipeline.config import ConfigError, DatasetConfig, PipelineConfig, check_sources
from eagle3_pipeline.generation import ResponseCheckpoint
from eagle3_pipeline.health import HealthReport
from eagle3_pipeline.hidden_states.sharding import ExtractionProgress, extraction_progress
from eagle3_pipeline.layout import ArtifactLayout


@dataclass(frozen=True)
class DatasetProgress:
    id: str
    prompts: int | None
    responses: int
    completion_tokens: int
    token_budget: int | None
    last_write_age_s: float | None
    source_problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "prompts": self.prompts,
            "responses": self.responses,
            "completion_tokens": self.completion_tokens,
            "token_budget": self.token_budget,
            "last_write_age_s": None if self.last_write_age_s is None else round(self.last_write_age_s, 1),
            "source_problem": self.source_problem,
        }


def source_problem(config: PipelineConfig, dataset: DatasetConfig) -> str | None:
    """Why ``dataset``'s source file cannot be read on this machine (its field and path), None if it can."""
    try:
        check_sources(config, only=[dataset])
    except ConfigError as exc:
        return str(exc).removeprefix(f"{config.source_file}: ")
    return None


def dataset_progress(config: PipelineConfig, now: float | None = None) -> list[DatasetProgress]:
    """Each dataset's prompts, answers, completion tokens and checkpoint age, read from its files, and
    whether its source file is readable here."""
    layout = ArtifactLayout(config.artifacts_root)
    now = time.time() if now is None else now
    rows = []
    for ds in config.datasets:
        prompts_path, checkpoint = layout.prompts(ds.id), layout.checkpoint(ds.id)
        prompts = pq.ParquetFile(prompts_path).metadata.num_rows if prompts_path.exists() else None
        records = ResponseCheckpoint(checkpoint).load().values()
        done, tokens = len(records), sum(int(r.get("completion_tokens") or 0) for r in records)
        age = now - checkpoint.stat().st_mtime if checkpoint.exists() else None
        rows.append(DatasetProgress(ds.id, prompts, done, tokens, ds.token_budget, age, source_problem(config, ds)))
    return rows


@dataclass(frozen=True)
class RunInFlight:
    run_id: str
    job: str
    partition: str | None
    status: str
    age_s: float | None


def status_document(report: HealthReport, progress: Sequence[DatasetProgress]) -> dict[str, Any]:
    """The `--json` shape: overall (the gate's verdict), checks and datasets, nothing else."""
    return {
        "overall": report.overall.value,
        "checks": [c.to_dict() for c in report.checks],
        "datasets": [p.to_dict() for p in progress],
    }


def exit_code(report: HealthReport) -> int:
    """0 exactly when the sensor would launch work (`report.healthy`: optional checks never gate)."""
    return 0 if report.healthy else 1


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def extraction_status(artifacts_root: Path) -> ExtractionProgress | None:
    """Hidden-state extraction into the local store (compute: local), None before it starts."""
    return extraction_progress(ArtifactLayout(artifacts_root).hidden_states)


def render_status(
    report: HealthReport,
    progress: Sequence[DatasetProgress],
    runs: Sequence[RunInFlight],
    extraction: ExtractionProgress | None = None,
) -> str:
    lines = [f"health: {report.overall.value.upper()}  ({report.summary()})", ""]
    width = max((len(c.name) for c in report.checks), default=5)
    lines += [
        f"  {c.status.value.upper():<8} {c.name:<{width}}  {c.detail}  [{c.host}]{'' if c.required else ' (optional)'}"
        for c in report.checks
    ]
    lines += ["", f"  {'dataset':<16}{'prompts':>9}{'responses':>11}{'tokens':>10}{'budget':>10}{'last write':>12}"]
    for p in progress:
        prompts = "-" if p.prompts is None else str(p.prompts)
        budget = "-" if p.token_budget is None else str(p.token_budget)
        lines.append(
            f"  {p.id:<16}{prompts:>9}{p.responses:>11}{p.completion_tokens:>10}{budget:>10}"
            f"{_age(p.last_write_age_s):>12}"
        )
    missing = [p.source_problem for p in progress if p.source_problem is not None]
    if missing:
        lines += ["", "  sources a run cannot read on this machine (it fails where it has to read its prompts):"]
        lines += [f"    {problem}" for problem in missing]
    if extraction is not None:
        lines += ["", f"  {extraction.line()}, last shard written {_age(extraction.last_write_age_s)} ago"]
    lines.append("")
    if runs:
        lines.append("runs in progress:")
        lines += [f"  {r.run_id[:8]}  {r.status:<9} {r.job}  {r.partition or '-'}  {_age(r.age_s)}" for r in runs]
    else:
        lines.append("runs in progress: none")
    return "\n".join(lines)
