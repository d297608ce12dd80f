"""The extracted states checked against the serving target before a large extraction.

:func:`validate_states`' parts (the extract phase, before the first shard): the reference samples
(recorded by :mod:`eagle3_pipeline.training_data.serving_reference`) through the state source; every state
finite and of the manifest's shape; ``argmax(teacher @ lm_head.T)`` (the teacher rounded to bf16, as
stored) against the server's token at every recorded position, near-ties and unknown positions
apart. It catches a teacher from the wrong layer, shifted by a position or without the final norm
(DESIGN.md "Validation against the serving target"). :func:`preflight_reference` records the
reference at ``hidden_states`` time when ``training_data`` could not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.config import HiddenStatesConfig, PipelineConfig, ServingValidationConfig, TargetConfig
from eagle3_pipeline.hidden_states.capture import SampleError
from eagle3_pipeline.hidden_states.extract_spec import ExtractionError, ExtractSpec
from eagle3_pipeline.hidden_states.sources import StateSource, decided
from eagle3_pipeline.target.folder import TargetError
from eagle3_pipeline.training_data.agreement import ServerEndpoint
from eagle3_pipeline.training_data.reader import TrainingData, TrainingDataError
from eagle3_pipeline.training_data.serving_reference import (
    ReferenceSample,
    ServingReference,
    ServingReferenceError,
    load_reference,
    record_from_first,
    tokenization_problems,
)

# Disagreeing positions named in a failure.
SHOWN = 8
# Vocabulary rows of lm_head multiplied at a time (bounds the float32 copy).
VOCAB_CHUNK = 16384


class ValidationFailed(RuntimeError):
    """The states disagree with the serving target; the message names samples and positions."""


def load_lm_head(model: str) -> Any:
    """The target's ``lm_head`` [vocab, hidden] read by name from its checkpoint folder (a Hugging
    Face id: its snapshot in the local cache, where transformers loaded it from)."""
    from eagle3_pipeline.target.folder import TargetError
    from eagle3_pipeline.target.weights import load_target_weights

    folder = Path(model)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            folder = Path(snapshot_download(model, local_files_only=True))
        except (LocalEntryNotFoundError, ValueError) as exc:
            raise TargetError(
                f"{model!r} is neither a folder nor a Hugging Face id in the local cache ({type(exc).__name__})"
            ) from None
    return load_target_weights(folder).lm_head


def teacher_argmax(hidden: Any, lm_head: Any) -> list[int]:
    """``argmax(hidden @ lm_head.T)`` per row, in float32, ``VOCAB_CHUNK`` vocabulary rows at a time."""
    import torch

    device = hidden.device if hidden.device.type == "cuda" else torch.device("cpu")
    states = hidden.to(device, torch.bfloat16).float()
    best = torch.full((states.shape[0],), -math.inf, device=device)
    which = torch.zeros(states.shape[0], dtype=torch.long, device=device)
    for start in range(0, lm_head.shape[0], VOCAB_CHUNK):
        logits = states @ lm_head[start : start + VOCAB_CHUNK].to(device, torch.float32).T
        value, index = logits.max(dim=-1)
        better = value > best
        best = torch.where(better, value, best)
        which = torch.where(better, index + start, which)
    return which.cpu().tolist()


@dataclass
class Comparison:
    compared: int = 0
    agreed: int = 0
    near_ties: int = 0
    near_tie_agreed: int = 0
    unknown: int = 0
    disagreements: list[str] = field(default_factory=list)


def check_states(sample: ReferenceSample, aux: Any, hidden: Any, aux_width: int, hidden_size: int) -> None:
    """Shapes as the manifest says and every value finite; :class:`ValidationFailed` otherwise."""
    import torch

    length = len(sample.input_ids)
    for name, tensor, width in (("aux_hidden_states", aux, aux_width), ("hidden_states", hidden, hidden_size)):
        if tuple(tensor.shape) != (length, width):
            raise ValidationFailed(
                f"sample {sample.sample_id!r}: {name} has shape {tuple(tensor.shape)}, "
                f"the manifest says ({length}, {width})"
            )
        bad = (~torch.isfinite(tensor.float())).nonzero()
        if len(bad):
            raise ValidationFailed(
                f"sample {sample.sample_id!r}: {name} has {len(bad)} non-finite values "
                f"(first at position {int(bad[0][0])})"
            )


def compare(sample: ReferenceSample, ours: Sequence[int], margin: float, into: Comparison) -> None:
    for position, theirs, gap in zip(sample.positions, sample.top1, sample.margin, strict=True):
        if theirs is None:
            into.unknown += 1
            continue
        same = ours[position] == theirs
        if gap is not None and gap < margin:
            into.near_ties += 1
            into.near_tie_agreed += same
            continue
        into.compared += 1
        into.agreed += same
        if not same:
            into.disagreements.append(f"{sample.sample_id!r}@{position}: ours {ours[position]}, server {theirs}")


def verdict(reference: ServingReference, result: Comparison, settings: ServingValidationConfig) -> dict[str, Any]:
    """The phase's metadata for a comparison; :class:`ValidationFailed` below ``min_agreement``."""
    share = result.agreed / result.compared if result.compared else 0.0
    meta = {
        "serving_validation": "passed",
        "serving_reference": f"{reference.server} ({reference.api}, {reference.model})",
        "serving_samples": len(reference.samples),
        "serving_positions": result.compared,
        "serving_agreement": round(share, 4),
        "serving_min_agreement": settings.min_agreement,
        "serving_near_ties": result.near_ties,
        "serving_unknown_positions": result.unknown,
        "serving_near_ties_known": reference.api != "text",
    }
    if result.near_ties:
        meta["serving_near_tie_agreement"] = round(result.near_tie_agreed / result.near_ties, 4)
    if not result.compared:
        return {
            **meta,
            "serving_validation": "not validated",
            "serving_validation_detail": f"no position could be compared with {reference.server} "
            f"({result.near_ties} near-ties, {result.unknown} positions whose prefix text does not tokenize back "
            "to the row's ids or whose answer is not one token)",
        }
    if share < settings.min_agreement:
        raise ValidationFailed(
            f"argmax(lm_head(teacher)) agrees with the serving target ({reference.server}, {reference.api}) "
            f"at {result.agreed} of {result.compared} positions ({share:.1%}) of {len(reference.samples)} samples, "
            f"below hidden_states.validation.min_agreement {settings.min_agreement:.0%} "
            f"({result.near_ties} near-ties within {settings.near_tie_logprob_margin} nats reported apart); "
            f"first disagreements: {'; '.join(result.disagreements[:SHOWN])}. "
            "The teacher is not the serving target's final state: "
            "a layer off, shifted by a position, or without the final norm"
        )
    return meta


def preflight_reference(config: PipelineConfig, training_data: Path, tokenizer_name: str, out: Path) -> dict[str, Any]:
    """The ``hidden_states`` preflight: keep a reference recorded for these rows, else record one
    now from a server that is up: with ``backend: vllm`` and ``compute: local`` the extraction server
    itself (asked under the name it serves, each completion's hidden-state file deleted; on a GPU host
    its URL and folder are the host's, not this machine's), else the inference endpoints (an SGLang
    server stopped for ``backend: sglang`` does not answer: record it at ``training_data`` time), or
    the embedded server, started here for the recording and stopped after it."""
    settings = config.hidden_states.validation
    if not settings.samples:
        return {"serving_reference_status": "off (hidden_states.validation.samples is 0)"}
    try:
        data = TrainingData.open(training_data)
    except (
        TrainingDataError
    ) as exc:  # the phase itself fails on it, after its cheaper refusals (busy GPUs, a missing python)
        return {"serving_reference_status": f"not recorded: {exc}"}
    kept, _ = load_reference(out, data.version())
    if kept is not None:
        return {"serving_reference_status": f"kept: recorded earlier for these rows from {kept.server} ({kept.api})"}
    reasons = []
    extraction = config.hidden_states
    if extraction.backend == "vllm" and extraction.vllm_base_url and config.compute.kind == "local":
        done = _record_from_extraction_server(extraction, config.target, training_data, tokenizer_name, out)
        if done["serving_reference_status"].startswith("recorded"):
            return done
        reasons.append(done["serving_reference_status"].removeprefix("not recorded: "))
    from eagle3_pipeline.config import ConfigError
    from eagle3_pipeline.health.gate import UnhealthyError
    from eagle3_pipeline.inference.embedded import ServerStartError
    from eagle3_pipeline.inference.provider import InferenceProvider
    from eagle3_pipeline.target.local_model import ModelNotAvailable

    endpoints = []
    provider = InferenceProvider(config)
    try:
        try:
            endpoints = [ServerEndpoint(e.base_url, e.model, e.api_key) for e in provider.endpoints()]
        except (UnhealthyError, ServerStartError, ModelNotAvailable, ConfigError) as exc:
            reasons.append(f"the inference endpoints: {type(exc).__name__}: {str(exc)[:300]}")
        done = record_from_first(
            training_data,
            endpoints,
            tokenizer_name=tokenizer_name,
            trust_remote_code=config.target.trust_remote_code,
            settings=settings,
            out=out,
        )
    finally:
        provider.close()
    if reasons and done["serving_reference_status"].startswith("not recorded"):
        done["serving_reference_status"] += "; " + "; ".join(reasons)
    return done


def _record_from_extraction_server(
    extraction: HiddenStatesConfig, target: TargetConfig, training_data: Path, tokenizer_name: str, out: Path
) -> dict[str, Any]:
    import httpx

    from eagle3_pipeline.hidden_states.vllm_capture import VllmError, reply_file_taker, served_model
    from eagle3_pipeline.hidden_states.vllm_server import extraction_url

    assert extraction.vllm_base_url is not None and extraction.vllm_output_dir is not None  # backend vllm
    url = extraction_url(extraction.vllm_base_url.rstrip("/"))
    try:
        with httpx.Client(timeout=extraction.validation.timeout_s) as http:
            served = served_model(http, url)
    except VllmError as exc:
        return {"serving_reference_status": f"not recorded: {exc}"}
    return record_from_first(
        training_data,
        [ServerEndpoint(url, served)],
        tokenizer_name=tokenizer_name,
        trust_remote_code=target.trust_remote_code,
        settings=extraction.validation,
        out=out,
        after_reply=reply_file_taker(Path(extraction.vllm_output_dir)),
    )


def _validation_reference(settings: ExtractSpec, data: TrainingData) -> dict[str, Any]:
    """The writer's part: the recorded reference's samples, or why there is nothing to validate against."""
    if not settings.validation.samples:
        return {"skip": "hidden_states.validation.samples is 0"}
    if settings.serving_reference is None:
        return {"skip": "no serving reference was given to the phase"}
    try:
        reference, reason = load_reference(Path(settings.serving_reference), data.version())
    except ServingReferenceError as exc:
        raise ExtractionError(str(exc)) from None
    if reference is None:
        return {"skip": reason}
    problems = tokenization_problems(reference)
    if problems:
        raise ExtractionError(
            "validation against the serving target: training_data was tokenized by a tokenizer other than "
            "the served model's "
            f"({reference.tokenizer} vs {reference.server}): {'; '.join(problems[:3])}"
        )
    return {"reference": reference}


def _load_lm_head(model: str) -> Any:
    try:
        return load_lm_head(model)
    except TargetError as exc:
        raise ExtractionError(
            f"validation against the serving target needs the target's lm_head from its checkpoint folder: {exc}"
        ) from None


def validate_first(
    source: StateSource, settings: ExtractSpec, data: TrainingData, aux_ids: Sequence[int], report: Reporter
) -> dict[str, Any]:
    """Before any shard: the reference samples through the source (every rank), their teacher's
    argmax under lm_head against the serving target's greedy tokens (the writer, which shares its
    verdict). Raises :class:`ExtractionError` below ``validation.min_agreement``; without a
    reference, says so."""
    found = decided(source, lambda: _validation_reference(settings, data))
    if "skip" in found:
        report.log(f"extract: NOT validated against the serving target: {found['skip']}")
        return {"serving_validation": "not validated", "serving_validation_detail": found["skip"]}
    reference = found["reference"]
    identity = source.identity
    loaded: dict[str, Any] = {}

    def load() -> bool:
        loaded["lm_head"] = _load_lm_head(settings.model)
        return True

    decided(source, load)
    result, failure = Comparison(), ""
    for sample in reference.samples:
        try:
            aux, hidden = source.reference_states(aux_ids, sample.input_ids)
        except SampleError as exc:
            raise ExtractionError(f"validation, sample {sample.sample_id!r}: {exc.message}") from None
        if not source.writer or failure:
            continue
        try:
            check_states(sample, aux, hidden, len(aux_ids) * identity.hidden_size, identity.hidden_size)
        except ValidationFailed as exc:
            failure = f"validation against the serving target: {exc}"
            continue
        compare(sample, teacher_argmax(hidden, loaded["lm_head"]), settings.validation.near_tie_logprob_margin, result)

    def decide() -> dict[str, Any]:
        if failure:
            raise ExtractionError(failure)
        try:
            return verdict(reference, result, settings.validation)
        except ValidationFailed as exc:
            raise ExtractionError(f"validation against the serving target, before extraction: {exc}") from None

    meta = decided(source, decide)
    if meta["serving_validation"] != "passed":
        report.log(f"extract: NOT validated against the serving target: {meta['serving_validation_detail']}")
        return meta
    near = (
        f"{meta['serving_near_ties']} near-ties apart"
        if meta["serving_near_ties_known"]
        else "near-ties unknown: the server gives no logprobs"
    )
    report.log(
        f"extract: validated against {meta['serving_reference']}: agreement {meta['serving_agreement']:.2%} over "
        f"{meta['serving_positions']} positions of {meta['serving_samples']} samples ({near})"
    )
    return {**meta, "serving_validation_detail": f"{result.agreed}/{result.compared} positions agree"}
