"""One dataset's responses phase end to end: generate what is missing, then write the table."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle3_pipeline.config import DatasetConfig, GenerationConfig
from eagle3_pipeline.generation.budget import BudgetState, budget_state
from eagle3_pipeline.generation.checkpoint import ResponseCheckpoint
from eagle3_pipeline.generation.conversation import RESPONSE_TABLE_SCHEMA, response_rows
from eagle3_pipeline.generation.endpoints import Endpoint
from eagle3_pipeline.generation.progress import ProgressSink
from eagle3_pipeline.generation.runner import GenerationFailed, GenerationSummary, generate
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.records import PromptRecord, write_parquet


@dataclass(frozen=True)
class DatasetResult:
    summary: GenerationSummary
    rows: list[dict[str, Any]]
    budget: BudgetState

    def as_metadata(self) -> dict[str, Any]:
        rows = self.rows
        finish = Counter(r["finish_reason"] for r in rows)
        latencies = [r["latency_s"] for r in rows if r["latency_s"] is not None]
        costs = [r["cost"] for r in rows if r["cost"] is not None]
        return {
            **self.summary.as_metadata(),
            **self.budget.as_metadata(),
            "rows": len(rows),
            "completion_tokens": sum(r["completion_tokens"] for r in rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "truncated": finish.get("length", 0),
            "truncation_rate": round(finish.get("length", 0) / len(rows), 4) if rows else 0.0,
            "finish_reasons": dict(finish),
            "latency_p50_s": round(percentile(latencies, 50), 3),
            "latency_p90_s": round(percentile(latencies, 90), 3),
            "latency_p99_s": round(percentile(latencies, 99), 3),
            "cost_total": round(sum(costs), 6),
            "rows_without_cost": len(rows) - len(costs),
            "models": sorted({str(r["model"]) for r in rows}),
        }


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1])


def generate_dataset(
    dataset: DatasetConfig,
    prompts: Sequence[PromptRecord],
    resolve_endpoints: Callable[[], Sequence[Endpoint]],
    settings: GenerationConfig,
    layout: ArtifactLayout,
    sinks: Sequence[ProgressSink] = (),
) -> DatasetResult:
    """Answer the prompts still missing from the dataset's checkpoint (within its token budget),
    then write the responses table from the checkpoint.

    Raises :class:`GenerationFailed` if the run was stopped, or if more prompts failed than
    ``max_failed_fraction`` allows; the table is then left as it was."""
    checkpoint = ResponseCheckpoint(layout.checkpoint(dataset.id), settings.fsync, settings.fsync_interval_s)
    summary = generate(prompts, resolve_endpoints, settings, checkpoint, layout.errors(dataset.id), dataset.token_budget, sinks)
    allowed = int(settings.max_failed_fraction * len(prompts))
    if summary.failed > allowed:
        raise GenerationFailed(
            f"{dataset.id}: {summary.failed} of {len(prompts)} requests failed (allowed: {allowed}); the finished "
            f"answers are checkpointed and a rerun retries only the rest. First errors: {'; '.join(summary.error_examples)}. "
            f"All of them: {layout.errors(dataset.id)}",
            summary,
        )
    rows = response_rows(prompts, checkpoint.load())
    write_parquet(rows, RESPONSE_TABLE_SCHEMA, layout.responses(dataset.id))
    return DatasetResult(summary, rows, budget_state(rows, dataset.token_budget, settings))


def table_budget_state(path: Path, budget: int | None, settings: GenerationConfig) -> BudgetState:
    """The budget as a written responses table stands (what the budget asset check verifies)."""
    table = pq.read_table(path)
    columns = [c for c in ("prompt_tokens", "completion_tokens", "turns") if c in table.column_names]
    return budget_state(table.select(columns).to_pylist(), budget, settings)
