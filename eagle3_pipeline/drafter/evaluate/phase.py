"""The ``evaluate`` heavy phase: τ of the trained drafter and of the bigram baseline on the eval split,
per dataset and per draft depth K, against the stored tokens and against the target's argmax.

``run(spec, report)`` (``compute.PHASES["evaluate"]``) reads the hidden-state store (C3), the draft
vocabulary (C4), the exported drafter (``None``: the bigram baseline alone) and the target folder's
``lm_head`` (``None``: τ against its argmax is reported as not computed). Each sample runs one
``ttt_forward`` of ``max(steps)`` steps; what it reports is :mod:`.eval_results`'. The spec, the
data–target agreement and the speedup estimate: drafter/DESIGN.md "Evaluation". torch is imported
inside the functions that need it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from pydantic import ValidationError, field_validator

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.config import DrafterConfig, DrafterEvalConfig
from eagle3_pipeline.config.loader import validation_problems
from eagle3_pipeline.drafter.evaluate.acceptance import (
    AcceptanceStats,
    target_reference,
)
from eagle3_pipeline.drafter.evaluate.bigram import BigramDrafter, fit_bigram
from eagle3_pipeline.drafter.evaluate.results import (
    HELD_OUT_NOTE,
    NOT_COMPUTED,
    TARGET_NOTE,
    Tally,
    results_metadata,
    totals,
)
from eagle3_pipeline.hidden_states.sharding import ROLLING_LAYOUT_FILE
from eagle3_pipeline.hidden_states.store import (
    AUX_KEY,
    HIDDEN_KEY,
    IDS_KEY,
    MASK_KEY,
    HiddenStateStore,
    ShardFile,
    StoreError,
    StoreManifest,
    load_draft_vocab,
)
from eagle3_pipeline.training_data.reader import TrainingData, iter_rows

ARGMAX_CHUNK_TOKENS = 1024
PROGRESS_EVERY_S = 10.0


class EvaluateError(ValueError):
    """A spec, store, vocabulary or drafter that cannot be evaluated; the message names which."""


class EvalSpec(DrafterEvalConfig):
    """The ``evaluate`` spec (JSON): the ``drafter_eval:`` section it reads (its fields, bounds and
    defaults), ``drafter:``'s tensor names, the held-out ids, and where things are on the machine where
    the phase runs. ``steps`` is sorted, each depth once."""

    store: Path
    draft_vocab: Path
    drafter: Path | None = None  # None: the bigram baseline alone
    target_weights: Path | None = None  # None: τ against the target's argmax is not computed
    # drafter.embedding_key / lm_head_key: the target's tensor names, with that section's default.
    embedding_key: str | None = DrafterConfig.model_fields["embedding_key"].default
    lm_head_key: str | None = DrafterConfig.model_fields["lm_head_key"].default
    held_out: dict[str, list[str]] | None = None  # dataset → ids (held_out_spec); None: a manifest from before
    held_out_version: str | None = None
    training_data: Path | None = None  # the bigram's counts for a rolling store, which keeps no train shard

    @field_validator("steps")
    @classmethod
    def _each_depth_once(cls, steps: list[int]) -> list[int]:
        return sorted(set(steps))


def spec_settings(section: DrafterEvalConfig, drafter: DrafterConfig) -> dict[str, Any]:
    """The spec's settings from the pipeline file's ``drafter_eval:`` and ``drafter:`` sections."""
    return {
        **section.model_dump(mode="json"),
        "embedding_key": drafter.embedding_key,
        "lm_head_key": drafter.lm_head_key,
    }


def parse_spec(spec: Mapping[str, Any]) -> EvalSpec:
    """The spec validated once; a missing, unknown or out-of-bounds key is refused by name."""
    try:
        return EvalSpec.model_validate(spec)
    except ValidationError as exc:
        raise EvaluateError(f"evaluate spec: {validation_problems(exc, spec)}") from None


def held_out_spec(training_data: Path) -> dict[str, Any]:
    """The spec's ``held_out`` (dataset → ids) and ``held_out_version`` from ``training_data``'s
    manifest.json; ``held_out`` None for a manifest from before the held-out slice."""
    path = Path(training_data) / "manifest.json"
    if not path.is_file():
        raise EvaluateError(
            f"{path}: no training_data manifest to read the held-out ids from; materialize training_data first"
        )
    manifest = json.loads(path.read_text())
    return {"held_out": manifest.get("held_out"), "held_out_version": manifest.get("version")}


def select_rows(
    store: HiddenStateStore, split: str, cap: int | None = None, always: AbstractSet[str] = frozenset()
) -> list[dict[str, Any]]:
    """The index rows of a split in index order, at most ``cap`` per dataset besides the ids in
    ``always`` (each taken)."""
    taken: dict[str, int] = {}
    rows = []
    for row in store.index().to_pylist():
        if row["split"] != split:
            continue
        if row["sample_id"] not in always:
            if cap is not None and taken.get(row["dataset"], 0) >= cap:
                continue
            taken[row["dataset"]] = taken.get(row["dataset"], 0) + 1
        rows.append(row)
    return rows


def read_rows(
    store: HiddenStateStore, rows: Sequence[dict[str, Any]], keys: Sequence[str]
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """``(row, {key: tensor})`` for each row, reading only ``keys`` (states in bf16 whatever the
    storage dtype); one shard open at a time."""
    by_shard: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_shard.setdefault(row["shard"], []).append(row)
    for shard, shard_rows in by_shard.items():
        path = store.root / f"{shard}.safetensors"
        if not path.is_file():
            raise StoreError(f"{path}: shard named in {store.index_path} is missing")
        tensors = ShardFile(path)
        for row in shard_rows:
            start, stop = row["offset"], row["offset"] + row["length"]
            yield row, {key: tensors.read(key, start, stop) for key in keys}


def fit_store_bigram(store: HiddenStateStore, t2d: Any, training_data: Path | None = None) -> BigramDrafter:
    """The bigram baseline counted over the store's train split (token ids and masks only). A rolling
    store (``hidden_states.rolling_window_shards``) keeps no train shard; the same ids and masks are
    then counted from ``training_data``'s train split, which the store's were copied from."""
    rows = select_rows(store, "train")
    if not rows and training_data is not None and (store.root / ROLLING_LAYOUT_FILE).is_file():
        data = TrainingData.open(training_data)
        columns = ["input_ids", "loss_mask"]
        return fit_bigram(
            ((r["input_ids"], r["loss_mask"]) for path in data.shard_files("train") for r in iter_rows(path, columns)),
            t2d,
        )
    if not rows:
        raise EvaluateError(f"{store.index_path}: no train sample to count the bigram baseline on")
    return fit_bigram(((t[IDS_KEY], t[MASK_KEY]) for _, t in read_rows(store, rows, (IDS_KEY, MASK_KEY))), t2d)


def drafter_predictions(model: Any, aux: Any, input_ids: Any, steps: int, attention_mask: Any = None) -> Any:
    """``pred [B, steps, T]`` target ids: depth j at index t drafts x_{t+2+j} (C6 ``ttt_forward``
    + ``draft_target_ids``), the tensor :class:`AcceptanceStats` takes per sample."""
    import torch

    with torch.inference_mode():
        logits = model.ttt_forward(aux, input_ids, steps, attention_mask)
        return torch.stack([model.draft_target_ids(step) for step in logits], dim=1)


def add_drafter_batch(
    stats: AcceptanceStats, model: Any, aux: Any, input_ids: Any, loss_mask: Any, attention_mask: Any = None
) -> None:
    """Draft a batch ([B, T, 3Ht], [B, T], [B, T]) ``max(stats.ks)`` deep and add each row to ``stats``.
    Right padding needs no trimming: padded positions have ``loss_mask`` 0. This is the call a training
    loop makes at each checkpoint to follow τ on its eval batches."""
    pred = drafter_predictions(model, aux, input_ids, stats.max_k, attention_mask)
    for row in range(pred.shape[0]):
        stats.add(pred[row], input_ids[row], loss_mask[row])


def _pick_device(setting: str) -> Any:
    import torch

    if setting == "cuda" and not torch.cuda.is_available():
        raise EvaluateError("evaluate spec: device is cuda but torch sees no CUDA device")
    return torch.device("cuda" if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()) else "cpu")


def load_drafter(spec: EvalSpec, d2t: Any, aux_layer_ids: Sequence[int], device: Any) -> Any:
    """The exported drafter on ``device``; refuses one trained with another vocabulary or other layers."""
    import torch

    from eagle3_pipeline.drafter.export.specforge import load_export

    assert spec.drafter is not None
    model = load_export(spec.drafter, spec.target_weights)
    if model.d2t.shape != d2t.shape or not torch.equal(model.d2t.cpu(), d2t.to(torch.int64)):
        raise EvaluateError(
            f"{spec.drafter}: the drafter's d2t differs from {spec.draft_vocab} (draft vocab "
            f"{tuple(model.d2t.shape)} vs {tuple(d2t.shape)}); it was trained with another draft vocabulary, so the "
            "bigram comparison would be unfair"
        )
    if list(model.config.aux_layer_ids) != list(aux_layer_ids):
        raise EvaluateError(
            f"{spec.drafter}: trained on aux layers {list(model.config.aux_layer_ids)}, but {spec.store} "
            f"holds layers {list(aux_layer_ids)}"
        )
    return model.to(device).eval()


def load_target_head(spec: EvalSpec, manifest: StoreManifest, device: Any) -> Any:
    """The target's ``lm_head`` [V, H] in float32 on ``device``; None without ``target_weights``.
    Refuses a target of another hidden or vocabulary size than the store's."""
    import torch

    from eagle3_pipeline.target.weights import load_target_weights

    if spec.target_weights is None:
        return None
    target = load_target_weights(spec.target_weights, spec.embedding_key, spec.lm_head_key)
    if (target.hidden_size, target.vocab_size) != (manifest.target.hidden_size, manifest.target.vocab_size):
        raise EvaluateError(
            f"{spec.target_weights}: the target has hidden {target.hidden_size}, vocab {target.vocab_size}; "
            f"{spec.store} was made from one with hidden {manifest.target.hidden_size}, vocab "
            f"{manifest.target.vocab_size} (drafter.target_weights names another model)"
        )
    return target.lm_head.to(device, torch.float32)


def target_next_argmax(hidden: Any, lm_head: Any, needed: Any = None) -> Any:
    """``argmax(hidden @ lm_head.T)`` per position ([T, H] → [T], in ``lm_head``'s dtype,
    ``ARGMAX_CHUNK_TOKENS`` positions at a time): the target's greedy choice for the token after each
    position. ``needed`` [T] (bool) limits the product to those positions (-1 elsewhere): a long
    prompt's positions are never compared with a draft."""
    import torch

    where = (
        torch.arange(hidden.shape[0], device=hidden.device)
        if needed is None
        else needed.to(hidden.device).nonzero().squeeze(1)
    )
    out = torch.full((hidden.shape[0],), -1, dtype=torch.long, device=hidden.device)
    with torch.inference_mode():
        for start in range(0, where.shape[0], ARGMAX_CHUNK_TOKENS):
            rows = where[start : start + ARGMAX_CHUNK_TOKENS]
            out[rows] = (hidden.index_select(0, rows).to(lm_head.dtype) @ lm_head.T).argmax(-1)
    return out


def held_out_rows(store: HiddenStateStore, spec: EvalSpec, manifest: StoreManifest) -> tuple[set[str], str]:
    """The held-out ids to evaluate, and the note saying what they are or why there are none.
    A held-out id in the store's train split is refused: the drafter would have trained on it."""
    if spec.held_out is None:
        return set(), (
            f"{NOT_COMPUTED}: no held-out ids in the evaluate spec (a training_data manifest from before "
            "training_data.held_out_per_dataset)"
        )
    wanted = {sample_id for ids in spec.held_out.values() for sample_id in ids}
    if not wanted:
        return set(), "none (training_data.held_out_per_dataset is 0)"
    if spec.held_out_version is not None and spec.held_out_version != manifest.training_data_version:
        return set(), (
            f"{NOT_COMPUTED}: the held-out ids are training_data version {spec.held_out_version}'s, {spec.store} holds "
            f"version {manifest.training_data_version}'s (materialize hidden_states again)"
        )
    splits = {row["sample_id"]: row["split"] for row in store.index().to_pylist() if row["sample_id"] in wanted}
    trained = sorted(sample_id for sample_id, split in splits.items() if split != "eval")
    if trained:
        raise EvaluateError(
            f"{store.index_path}: held-out id(s) {', '.join(trained[:5])} are in the {splits[trained[0]]} split; "
            "training_data forces them into eval, so the store was not made from that training_data "
            "(materialize hidden_states again)"
        )
    missing = len(wanted) - len(splits)
    counts = ", ".join(f"{dataset} {len(ids)}" for dataset, ids in sorted(spec.held_out.items()))
    return set(splits), (
        f"the ids training_data holds out per dataset (training_data.held_out_per_dataset; {counts}): the same every "
        "run for the same prompts and seed, always in the eval split, never trained on"
        + (f"; {missing} of them not in {spec.store}" if missing else "")
    )


def run(spec: dict[str, Any], report: Reporter) -> dict[str, Any]:
    """The ``evaluate`` phase; returns JSON-able metadata (see :func:`results_metadata`)."""
    import torch

    settings = parse_spec(spec)
    store = HiddenStateStore(settings.store)
    manifest = store.manifest()
    d2t, t2d, _ = load_draft_vocab(settings.draft_vocab)
    if t2d.shape[0] != manifest.target.vocab_size:
        raise EvaluateError(
            f"{settings.draft_vocab}: t2d covers {t2d.shape[0]} target tokens, but {settings.store} was made with a "
            f"vocabulary of {manifest.target.vocab_size}"
        )
    started = time.monotonic()
    bigram_model = fit_store_bigram(store, t2d, settings.training_data)
    report.log(f"bigram baseline: {bigram_model.pairs} train pairs, {bigram_model.seen} tokens with a successor")
    held_ids, held_note = held_out_rows(store, settings, manifest)
    rows = select_rows(store, "eval", settings.max_samples_per_dataset, held_ids)
    if not rows:
        raise EvaluateError(f"{store.index_path}: no eval sample; the eval split is empty")
    device = _pick_device(settings.device)
    model = load_drafter(settings, d2t, manifest.aux_layer_ids, device) if settings.drafter is not None else None
    lm_head = load_target_head(settings, manifest, device)
    depth = max(settings.steps)
    keys = (
        IDS_KEY,
        MASK_KEY,
        *((AUX_KEY,) if model is not None else ()),
        *((HIDDEN_KEY,) if lm_head is not None else ()),
    )
    groups: dict[str, Tally] = {}
    held: dict[str, Tally] = {}
    last_report = time.monotonic()
    for done, (row, tensors) in enumerate(read_rows(store, rows, keys), start=1):
        ids, mask = tensors[IDS_KEY].long(), tensors[MASK_KEY].bool()
        bigram_pred = bigram_model.predict(ids, depth)
        drafter_pred = None
        if model is not None:
            drafter_pred = drafter_predictions(model, tensors[AUX_KEY][None].to(device), ids[None].to(device), depth)[0]
        reference = None
        if lm_head is not None:  # the argmax at p is compared at p + 1, a response position
            needed = torch.cat([mask[1:], mask.new_zeros(1)])
            reference = target_reference(ids, target_next_argmax(tensors[HIDDEN_KEY].to(device), lm_head, needed))
        for tallies in (groups, held) if row["sample_id"] in held_ids else (groups,):
            if row["dataset"] not in tallies:
                tallies[row["dataset"]] = Tally.empty(settings.steps, model is not None, lm_head is not None)
            tallies[row["dataset"]].add(ids, mask, bigram_pred, drafter_pred, reference)
        if time.monotonic() - last_report >= PROGRESS_EVERY_S or done == len(rows):
            last_report = time.monotonic()
            report.progress({"eval_samples_done": done, "eval_samples": len(rows)})
    del model, lm_head
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reference_note = (
        f"the argmax of {settings.target_weights}'s lm_head over the store's final states"
        if settings.target_weights is not None
        else (
            f"{NOT_COMPUTED}: the evaluate spec names no target_weights "
            "(the target folder whose lm_head gives its argmax)"
        )
    )
    metadata = results_metadata(
        totals(groups),
        totals(held),
        settings.draft_cost_ratio,
        settings.min_data_agreement,
        {TARGET_NOTE: reference_note, HELD_OUT_NOTE: held_note},
    )
    metadata["eval_seconds"] = round(time.monotonic() - started, 1)
    metadata["drafter"] = str(settings.drafter) if settings.drafter else "none (bigram baseline only)"
    report.log("acceptance on the eval split:\n" + metadata["table"])
    return metadata
