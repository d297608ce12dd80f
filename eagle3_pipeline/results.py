"""Typed phase results, and the listener a caller in the same process hears them on.

Each phase's result is a small frozen dataclass: its typed fields are the figures a reader of the
phase relies on (the CLI's summary reads them by attribute, so a renamed field is an error, not a
silent 0), `extra` holds every other figure the phase produced, and `as_metadata()` is the whole
of it as the flat dict an asset records (same keys as the phase's metadata). `from_metadata` builds
one from what the phase returned — the heavy phases' results cross a process boundary as JSON — and
refuses a result that lacks a typed field or holds one of the wrong type, naming the field.

Phase (asset) → result type:
  prompts        → PromptsResult
  responses      → ResponsesResult
  training_data  → TrainingDataResult
  draft_vocab    → eagle3_pipeline.draft_vocab.DraftVocabResult (built by the domain function itself)
  hidden_states  → HiddenStatesResult
  eagle3_drafter → DrafterResult
  drafter_eval   → DrafterEvalResult
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Self

if TYPE_CHECKING:
    # Only in annotations: the domain modules import this one (and generation's __init__ imports them).
    from eagle3_pipeline.generation.progress import Progress


class ResultError(ValueError):
    """A phase's result lacks a field its readers rely on, or holds one of the wrong type."""


class PhaseResult(Protocol):
    def as_metadata(self) -> dict[str, Any]: ...


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


def _accepts(annotation: Any, value: Any) -> bool:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_accepts(arg, value) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation) or annotation
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin)


@dataclass(frozen=True, kw_only=True)
class MetadataResult:
    """Typed fields (declared by each subclass) + `extra`: everything else the phase reported."""

    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def typed_fields(cls) -> list[dataclasses.Field[Any]]:
        return [f for f in dataclasses.fields(cls) if f.name != "extra"]

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Self:
        hints = typing.get_type_hints(cls)
        names = [f.name for f in cls.typed_fields()]
        required = [
            f.name
            for f in cls.typed_fields()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in metadata]
        if missing:
            raise ResultError(
                f"{cls.__name__}: the phase's result lacks {', '.join(missing)} "
                f"(it has: {', '.join(sorted(metadata)) or 'nothing'})"
            )
        wrong = [
            f"{name} = {metadata[name]!r} (expected {hints[name]})"
            for name in names
            if name in metadata and not _accepts(hints[name], metadata[name])
        ]
        if wrong:
            raise ResultError(f"{cls.__name__}: the phase's result has the wrong type in {'; '.join(wrong)}")
        typed = {name: metadata[name] for name in names if name in metadata}
        return cls(**typed, extra={k: v for k, v in metadata.items() if k not in names})

    def as_metadata(self) -> dict[str, Any]:
        typed = {f.name: getattr(self, f.name) for f in self.typed_fields()}
        return {**typed, **self.extra}


@dataclass(frozen=True, kw_only=True)
class PromptsResult(MetadataResult):
    prompts: int
    records_read: int
    short: int
    long: int
    estimated_prompt_tokens: int


@dataclass(frozen=True, kw_only=True)
class ResponsesResult(MetadataResult):
    rows: int
    generated_now: int
    completion_tokens: int
    truncated: int
    data_version: str


@dataclass(frozen=True, kw_only=True)
class TrainingDataResult(MetadataResult):
    rows: int
    train_rows: int
    eval_rows: int
    tokens: int
    masked_tokens: int
    over_length_dropped: int


@dataclass(frozen=True, kw_only=True)
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


@dataclass(frozen=True, kw_only=True)
class DrafterResult(MetadataResult):
    """A run that trained no step (resumed at its last step) has no loss: None."""

    steps: int
    total_steps: int
    first_loss: float | None
    last_loss: float | None
    export_dir: str


@dataclass(frozen=True, kw_only=True)
class DrafterEvalResult(MetadataResult):
    """`table` is the τ table in markdown; the τ figures (`tau@K/<dataset>`…) are in `extra`,
    keyed as `eagle3_pipeline.drafter.evaluate.summary_table` reads them."""

    table: str
