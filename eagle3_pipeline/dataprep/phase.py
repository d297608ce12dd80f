"""The training_data phase end to end: the tokenizer agreement preflight, the build, the serving
reference for hidden_states' validation, and the phase's typed result."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import GenerationConfig, ServingValidationConfig, TargetConfig, TrainingDataConfig
from eagle3_pipeline.dataprep.agreement import ServerEndpoint, tokenizer_agreement
from eagle3_pipeline.dataprep.build import DataprepStats, build_training_data, read_manifest
from eagle3_pipeline.hidden_states.validation import record_from_first
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.results import TrainingDataResult


@dataclass(frozen=True)
class TrainingDataPhase:
    """What the phase built: the build's statistics, the store's version and the typed result."""

    stats: DataprepStats
    version: str
    result: TrainingDataResult


def make_training_data(
    response_files: Sequence[Path],
    tokenizer: str,
    layout: ArtifactLayout,
    seed: int,
    settings: TrainingDataConfig,
    target: TargetConfig,
    generation: GenerationConfig,
    validation: ServingValidationConfig,
    servers: Sequence[ServerEndpoint],
    log: Callable[[str], None],
) -> TrainingDataPhase:
    """Check that ``servers`` tokenize as ``tokenizer`` does (``settings.tokenizer_check_samples``;
    raises :class:`~eagle3_pipeline.dataprep.agreement.TokenizerDisagreement`), build the store
    from ``response_files`` (:func:`build_training_data`), then record the serving reference from
    the first of ``servers`` that answers; ``log`` hears one line for each of the two checks."""
    agreement: dict[str, Any] = {}
    if settings.tokenizer_check_samples:
        agreement = tokenizer_agreement(
            response_files,
            tokenizer,
            target.trust_remote_code,
            generation.chat_template_kwargs,
            servers,
            settings.tokenizer_check_samples,
        )
        log(f"tokenizer agreement: {agreement['tokenizer_agreement']} ({agreement['tokenizer_agreement_detail']})")
    stats = build_training_data(
        response_files,
        tokenizer,
        layout.training_data,
        seed=seed,
        eval_fraction=settings.eval_fraction,
        shard_rows=settings.shard_rows,
        max_seq_len=target.max_seq_len,
        reasoning=settings.reasoning,
        buffer_rows=settings.buffer_rows,
        trust_remote_code=target.trust_remote_code,
        chat_template_kwargs=generation.chat_template_kwargs,
        held_out_per_dataset=settings.held_out_per_dataset,
    )
    reference = record_from_first(
        layout.training_data, servers, tokenizer, target.trust_remote_code, validation, layout.serving_reference
    )
    log(f"serving reference for hidden_states' validation: {reference['serving_reference_status']}")
    version = read_manifest(layout.training_data)["version"]
    result = TrainingDataResult.from_metadata(
        {**stats.as_metadata(), **agreement, **reference, "version": version, "tokenizer": tokenizer}
    )
    return TrainingDataPhase(stats, version, result)
