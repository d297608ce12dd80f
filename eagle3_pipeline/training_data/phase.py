"""The training_data phase end to end: the tokenizer agreement preflight, the build, the serving
reference for hidden_states' validation, and the phase's typed result.

A finished phase needs no server: each run records what it was made from (:func:`phase_identity`: the
responses' bytes, the tokenizer's files, the settings, the servers it asks) and what it reported, beside
the folder. A rerun with the same identity whose store is still there, and that left nothing undone
(the tokenizer agreement checked, the serving reference recorded, where servers were configured), reuses
them without building or asking any server; anything else runs the phase as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import GenerationConfig, ServingValidationConfig, TargetConfig, TrainingDataConfig
from eagle3_pipeline.generation.fingerprint import endpoint_identity
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.records import atomic_path, sha256_file
from eagle3_pipeline.results import TrainingDataResult
from eagle3_pipeline.training_data.agreement import ServerEndpoint, tokenizer_agreement
from eagle3_pipeline.training_data.build import build_training_data, read_manifest
from eagle3_pipeline.training_data.serving_reference import ServingReferenceError, load_reference, record_from_first

# A local tokenizer folder's files that make its tokenization and chat template (not the weights).
TOKENIZER_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".py", ".tiktoken")


@dataclass(frozen=True)
class TrainingDataPhase:
    """What the phase built (or reused: ``reused``): the store's version and the typed result."""

    version: str
    result: TrainingDataResult
    reused: bool = False


def phase_identity(
    response_files: Sequence[Path],
    *,
    tokenizer: str,
    seed: int,
    settings: TrainingDataConfig,
    target: TargetConfig,
    generation: GenerationConfig,
    validation: ServingValidationConfig,
    servers: Sequence[ServerEndpoint],
) -> dict[str, Any]:
    """What the phase's outputs depend on; a local tokenizer folder by its tokenizer and template files."""
    folder = Path(tokenizer)
    files = (
        {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file() and p.suffix in TOKENIZER_SUFFIXES}
        if folder.is_dir()
        else None
    )
    return {
        "responses": {str(path): sha256_file(path) for path in response_files},
        "tokenizer": tokenizer,
        "tokenizer_files": files,
        "seed": seed,
        "training_data": settings.model_dump(mode="json"),
        "max_seq_len": target.max_seq_len,
        "trust_remote_code": target.trust_remote_code,
        "chat_template_kwargs": generation.chat_template_kwargs,
        "validation": validation.model_dump(mode="json"),
        "servers": [endpoint_identity(s.base_url) for s in servers],
    }


def finished_phase(
    layout: ArtifactLayout,
    identity: dict[str, Any],
    settings: TrainingDataConfig,
    validation: ServingValidationConfig,
    servers: Sequence[ServerEndpoint],
) -> TrainingDataPhase | None:
    """The recorded run, if it had ``identity``, its store is the one on disk and it left nothing a
    server could still do; else None (the phase runs)."""
    try:
        record = json.loads(layout.training_data_record.read_text())
        version = read_manifest(layout.training_data)["version"]
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("identity") != identity or record.get("version") != version:
        return None
    result = TrainingDataResult.from_metadata(record["result"])
    if servers and settings.tokenizer_check_samples and result.extra.get("tokenizer_agreement") != "ok":
        return None
    if servers and validation.samples:
        try:
            kept, _ = load_reference(layout.serving_reference, version)
        except ServingReferenceError:
            return None
        if kept is None:
            return None
    return TrainingDataPhase(version, result, reused=True)


def make_training_data(
    response_files: Sequence[Path],
    *,
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
    raises :class:`~eagle3_pipeline.training_data.agreement.TokenizerDisagreement`), build the store
    from ``response_files`` (:func:`build_training_data`), then record the serving reference from
    the first of ``servers`` that answers; ``log`` hears one line for each of the two checks. A
    finished run of the same identity is reused (:func:`finished_phase`): no build, no server asked."""
    identity = phase_identity(
        response_files,
        tokenizer=tokenizer,
        seed=seed,
        settings=settings,
        target=target,
        generation=generation,
        validation=validation,
        servers=servers,
    )
    finished = finished_phase(layout, identity, settings, validation, servers)
    if finished is not None:
        log(
            f"training_data: reusing version {finished.version}, made from the same responses, tokenizer and "
            "settings (tokenizer agreement and serving reference as recorded then; no server asked)"
        )
        return finished
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
        layout.training_data,
        servers,
        tokenizer_name=tokenizer,
        trust_remote_code=target.trust_remote_code,
        settings=validation,
        out=layout.serving_reference,
    )
    log(f"serving reference for hidden_states' validation: {reference['serving_reference_status']}")
    version = read_manifest(layout.training_data)["version"]
    result = TrainingDataResult.from_metadata(
        {**stats.as_metadata(), **agreement, **reference, "version": version, "tokenizer": tokenizer}
    )
    with atomic_path(layout.training_data_record) as tmp:
        tmp.write_text(json.dumps({"identity": identity, "version": version, "result": result.as_metadata()}))
    return TrainingDataPhase(version, result)
