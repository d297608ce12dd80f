"""The `extract` phase's spec (contract C5) as the phase reads it: the `hidden_states:` settings plus
where things are, validated where the phase runs (:func:`parse_spec`); built from the pipeline file
by :func:`eagle3_pipeline.hidden_states.extract.spec_from_config`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, ValidationError

from eagle3_pipeline.config import HiddenStatesConfig
from eagle3_pipeline.config.loader import validation_problems
from eagle3_pipeline.hidden_states.store import TargetIdentity, default_aux_layer_ids


class ExtractionError(RuntimeError):
    """The phase cannot (or must not) go on; the message says why and what to change."""


class ExtractSpec(HiddenStatesConfig):
    """The spec of the `extract` phase (JSON): the `hidden_states:` settings plus where things are.
    Paths are on the machine where the phase runs."""

    training_data: str
    output: str
    # Required here where the settings allow None (the resolved model folder); pydantic lets a subclass
    # narrow a field, pyright wants the default kept.
    model: str  # pyright: ignore[reportGeneralTypeIssues]
    # auto is chosen before the spec is built (eagle3_pipeline.fit.runtime.resolved).
    batch_tokens: Annotated[int, Field(gt=0)] = 8192  # pyright: ignore[reportIncompatibleVariableOverride]
    rolling_window_shards: Annotated[int, Field(gt=0)] | None = None  # pyright: ignore[reportIncompatibleVariableOverride]
    target_name: str
    trust_remote_code: bool = False
    shards: list[str] | None = None  # rolling: extract only these assigned shards (a window) into the existing store
    delete_shards: list[str] | None = None  # rolling: delete these shards' files (a trained window), nothing else
    # The serving target's recorded answers (training_data.serving_reference); None: not validated.
    serving_reference: str | None = None


def parse_spec(spec: dict[str, Any]) -> ExtractSpec:
    """The spec validated once; a missing, unknown or out-of-bounds key is refused by name."""
    try:
        return ExtractSpec.model_validate(spec)
    except ValidationError as exc:
        raise ExtractionError(f"extract spec: {validation_problems(exc, spec)}") from None


def aux_layer_ids(settings: HiddenStatesConfig, identity: TargetIdentity) -> list[int]:
    """The store's aux layer ids (output of layer): ``aux_layer_ids``, else the EAGLE-3 default for the target."""
    return list(settings.aux_layer_ids or default_aux_layer_ids(identity.num_layers))
