"""What the checks on a finished responses table look at, read against the files it was made from
(the prompts, the checkpoint, the errors file and the accounting of skipped prompts) — so that a
check can find what the step that wrote the table got wrong or what changed since.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from eagle3_pipeline.config import GenerationConfig
from eagle3_pipeline.generation.budget import budget_state
from eagle3_pipeline.generation.checkpoint import ResponseCheckpoint
from eagle3_pipeline.generation.dataset import read_accounting
from eagle3_pipeline.generation.fingerprint import read_fingerprint
from eagle3_pipeline.layout import ArtifactLayout

EXAMPLES = 5


def examples(ids: Sequence[str]) -> str:
    return ", ".join(ids[:EXAMPLES]) + (f" (+{len(ids) - EXAMPLES} more)" if len(ids) > EXAMPLES else "")


@dataclass(frozen=True)
class ResponseTableQuality:
    rows: int
    truncated: int
    models: tuple[str, ...]

    @property
    def truncation_rate(self) -> float:
        return self.truncated / self.rows if self.rows else 0.0


def inspect_responses(path: Path) -> ResponseTableQuality:
    """Reads only the columns the checks look at (not the conversations)."""
    table = pq.read_table(path, columns=["finish_reason", "model"])
    finish = table.column("finish_reason").to_pylist()
    models = Counter(str(m) for m in table.column("model").to_pylist())
    return ResponseTableQuality(table.num_rows, sum(1 for f in finish if f == "length"), tuple(sorted(models)))


@dataclass(frozen=True)
class PromptAccounting:
    """Every prompt of a dataset, by what became of it; and answers that belong to no prompt."""

    prompts: int
    answered: int
    failed: tuple[str, ...]
    empty_failed: tuple[str, ...]
    over_length: int
    held_back: int
    budget_reached: bool
    unaccounted: tuple[str, ...]
    orphans: tuple[str, ...]
    not_in_checkpoint: tuple[str, ...]

    @property
    def sent(self) -> int:
        return self.prompts - self.over_length

    @property
    def empty_rate(self) -> float:
        return len(self.empty_failed) / self.sent if self.sent else 0.0

    @property
    def consistent(self) -> bool:
        return not (self.unaccounted or self.orphans or self.not_in_checkpoint)

    def verdict(self) -> str:
        problems = []
        if self.orphans:
            problems.append(
                f"{len(self.orphans)} answers whose id is not among the prompts, e.g. {examples(self.orphans)}"
            )
        if self.not_in_checkpoint:
            problems.append(
                f"{len(self.not_in_checkpoint)} rows not in the checkpoint, e.g. {examples(self.not_in_checkpoint)}"
            )
        if self.unaccounted:
            problems.append(
                f"{len(self.unaccounted)} prompts neither answered, failed, over length nor skipped by the budget, "
                f"e.g. {examples(self.unaccounted)}"
            )
        if problems:
            return (
                "; ".join(problems) + " (rematerialize responses to rebuild the table from the prompts and checkpoint)"
            )
        return (
            f"{self.prompts} prompts: {self.answered} answered, {len(self.failed)} failed, "
            f"{self.over_length} over length, "
            f"{'the rest skipped by the reached budget' if self.budget_reached else 'budget not reached'}"
        )


def _error_ids(path: Path) -> dict[str, str]:
    """Each id of the errors file with the kind of its last failure."""
    kinds: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return kinds
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            kinds[str(entry["id"])] = str(entry.get("kind") or "error")
        except (ValueError, KeyError, TypeError):
            continue
    return kinds


def account_for_prompts(
    layout: ArtifactLayout, dataset_id: str, budget: int | None, settings: GenerationConfig
) -> PromptAccounting:
    """The responses table against the prompts, the checkpoint, the errors file and the accounting."""
    prompt_ids = set(pq.read_table(layout.prompts(dataset_id), columns=["id"]).column("id").to_pylist())
    table = pq.read_table(layout.responses(dataset_id), columns=["id", "prompt_tokens", "completion_tokens", "turns"])
    rows = table.to_pylist()
    answered = {r["id"] for r in rows}
    checkpoint = ResponseCheckpoint(layout.checkpoint(dataset_id)).load()
    accounting = read_accounting(layout.accounting(dataset_id))
    over = set(accounting.get("over_length", [])) & prompt_ids
    held_back = set(accounting.get("held_back_by_budget", [])) & set(checkpoint)
    errors = {i: k for i, k in _error_ids(layout.errors(dataset_id)).items() if i in prompt_ids and i not in answered}
    reached = budget_state(rows, budget, settings).reached
    missing = prompt_ids - answered - set(errors) - over - held_back
    return PromptAccounting(
        prompts=len(prompt_ids),
        answered=len(answered & prompt_ids),
        failed=tuple(sorted(errors)),
        empty_failed=tuple(sorted(i for i, k in errors.items() if k == "empty")),
        over_length=len(over),
        held_back=len(held_back),
        budget_reached=reached,
        unaccounted=tuple(sorted(missing)) if not reached else (),
        orphans=tuple(sorted(answered - prompt_ids)),
        not_in_checkpoint=tuple(sorted(answered - set(checkpoint))),
    )


@dataclass(frozen=True)
class ModelConsistency:
    table_models: tuple[str, ...]
    requested: str | None

    @property
    def single(self) -> bool:
        return len(self.table_models) <= 1

    def verdict(self) -> str:
        if not self.single:
            return f"answers of {len(self.table_models)} different models in one table: {', '.join(self.table_models)}"
        served = self.table_models[0] if self.table_models else "none yet"
        return f"one model: {served} (requested as {self.requested!r})"


def model_consistency(layout: ArtifactLayout, dataset_id: str) -> ModelConsistency:
    document = read_fingerprint(layout.fingerprint(dataset_id))
    requested = str(document["fingerprint"].get("model")) if document else None
    return ModelConsistency(inspect_responses(layout.responses(dataset_id)).models, requested)
