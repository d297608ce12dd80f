"""Typed phase results, and the listener a caller in the same process hears them on.

Each phase's result is a small frozen pydantic model: its typed fields are the figures a reader of the
phase relies on (the CLI's summary reads them by attribute, so a renamed field is an error, not a
silent 0), `extra` holds every other figure the phase produced, and `as_metadata()` is the whole
of it as the flat dict an asset records (same keys as the phase's metadata). `from_metadata` builds
one from what the phase returned — the heavy phases' results cross a process boundary as JSON — and
refuses a result that lacks a typed field or holds one of the wrong type, naming the field.

Phase (asset) → result type:
  prompts        → PromptsResult
  responses      → ResponsesResult
  training_data  → TrainingDataResult
  draft_vocab    → eagle3_pipeline.hidden_states.draft_vocab.DraftVocabResult (built by the domain function itself)
  hidden_states  → HiddenStatesResult
  eagle3_drafter → DrafterResult
  drafter_eval   → DrafterEvalResult
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationError

if TYPE_CHECKING:
    # Only in annotations: the domain modules import this one (and generation's __init__ imports them).
    from eagle3_pipeline.generation.progress import Progress


class ResultError(ValueError):
    """A phase's result lacks a field its readers rely on, or holds one of the wrong type."""


class PhaseResult(Protocol):
    def as_metadata(self) -> dict[str, Any]: ...


@runtime_checkable
class PhaseListener(Protocol):
    """Hears a run's progress and phase results in the process the run executes in (the CLI);
    the UI and the daemon use `NO_LISTENER`, and read the same figures from the event log."""

    def progress(self, snapshot: Progress) -> None: ...

    def result(self, asset: str, partition: str | None, result: PhaseResult) -> None: ...


class _NoListener:
    def progress(self, snapshot: Progress) -> None:
        pass

    def result(self, asset: str, partition: str | None, result: PhaseResult) -> None:
        pass


NO_LISTENER: PhaseListener = _NoListener()


class MetadataResult(BaseModel):
    """Typed fields (declared by each subclass, checked strictly by pydantic: no "3" for an int, no
    bool for a number) + `extra`: everything else the phase reported."""

    model_config = ConfigDict(frozen=True, strict=True, extra="allow")

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Self:
        try:
            return cls.model_validate(dict(metadata))
        except ValidationError as exc:
            raise ResultError(_explain(cls, metadata, exc)) from None

    def as_metadata(self) -> dict[str, Any]:
        typed = {name: getattr(self, name) for name in type(self).model_fields}
        return {**typed, **self.extra}


def _explain(cls: type[MetadataResult], metadata: Mapping[str, Any], exc: ValidationError) -> str:
    """The refusal, naming the missing fields, or each wrong one with its value and expected type."""
    errors = dict.fromkeys((str(e["loc"][0]), e["type"]) for e in exc.errors())
    missing = [name for name, kind in errors if kind == "missing"]
    if missing:
        return (
            f"{cls.__name__}: the phase's result lacks {', '.join(missing)} "
            f"(it has: {', '.join(sorted(metadata)) or 'nothing'})"
        )
    wrong = [f"{name} = {metadata[name]!r} (expected {cls.model_fields[name].annotation})" for name, _ in errors]
    return f"{cls.__name__}: the phase's result has the wrong type in {'; '.join(wrong)}"


class PromptsResult(MetadataResult):
    prompts: int
    records_read: int
    short: int
    long: int
    estimated_prompt_tokens: int


class ResponsesResult(MetadataResult):
    rows: int
    generated_now: int
    completion_tokens: int
    truncated: int
    data_version: str


class TrainingDataResult(MetadataResult):
    rows: int
    train_rows: int
    eval_rows: int
    tokens: int
    masked_tokens: int
    over_length_dropped: int


class HiddenStatesResult(MetadataResult):
    """From the `extract` phase or the `import-specforge` importer; the importer writes every
    shard it finds, so it reports no written/reused split (None)."""

    store: str
    samples: int
    tokens: int
    bytes: int
    bytes_per_token: float
    bytes_per_token_formula: int
    target_hidden_size: int
    aux_layer_ids: list
    shards: int
    shards_written: int | None = None
    shards_reused: int | None = None


class DrafterResult(MetadataResult):
    """A run that trained no step (resumed at its last step) has no loss: None."""

    steps: int
    total_steps: int
    first_loss: float | None
    last_loss: float | None
    export_dir: str


class DrafterEvalResult(MetadataResult):
    """`table` is the τ table in markdown; the τ figures (`tau@K/<dataset>`…) are in `extra`,
    keyed as `eagle3_pipeline.drafter.evaluate.phase.summary_table` reads them."""

    table: str
