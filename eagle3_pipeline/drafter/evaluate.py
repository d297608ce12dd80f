"""The ``evaluate`` heavy phase: τ of the trained drafter and of the bigram baseline on the eval split.

``run(spec, report)`` (``compute.PHASES["evaluate"]``) reads, where it runs:

- ``store``: the hidden-state store (C3): the eval split's aux states and tokens, and the train
  split's tokens for the bigram counts;
- ``draft_vocab``: ``d2t``/``t2d`` (C4), the vocabulary both drafters draft in;
- ``drafter``: the exported drafter folder (``export.load_export``), with ``target_weights`` (the
  target model folder) for an export that leaves the embedding to the target; ``None`` evaluates
  the bigram baseline alone (e.g. before any training);
- ``steps`` (draft depths K, default 3, 5, 7), ``max_samples_per_dataset``, ``device``
  (auto|cpu|cuda), ``draft_cost_ratio`` (for the speedup estimate).

Each eval sample runs one ``ttt_forward`` of ``max(steps)`` steps (chain drafts at depth j do not
depend on K, so K = 3 and 5 are the first depths of the same pass); ``draft_target_ids`` gives
``pred [K, T]`` for :mod:`eagle3_pipeline.drafter.acceptance`, and the bigram drafter fills the same
tensor from the same tokens.

Speedup estimate (an estimate, not a measurement; ``drafter_benchmark`` measures): one verify step
costs K draft forwards and one target forward, which verifies K+1 tokens for about the price of one
in memory-bound decoding; it yields τ tokens. So speedup ≈ τ_K / (1 + K·c), with c the cost of a
draft forward relative to a target forward. The default c = 1/61 counts layers: one draft decoder
layer against a 61-layer target (the draft's fc and lm_head roughly offset the target's being MoE).

torch is imported inside the functions that need it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.drafter.acceptance import ALL, AcceptanceStats, stats_metadata, with_total
from eagle3_pipeline.drafter.bigram import BigramDrafter, fit_bigram
from eagle3_pipeline.hidden_states.store import AUX_KEY, IDS_KEY, MASK_KEY, HiddenStateStore, StoreError, load_draft_vocab

DEFAULT_STEPS = (3, 5, 7)
DEFAULT_DRAFT_COST_RATIO = round(1 / 61, 4)
BIGRAM = "bigram_"
PROGRESS_EVERY_S = 10.0


class EvaluateError(ValueError):
    """A spec, store, vocabulary or drafter that cannot be evaluated; the message names which."""


@dataclass(frozen=True)
class EvalSpec:
    store: Path
    draft_vocab: Path
    drafter: Path | None
    target_weights: Path | None
    steps: tuple[int, ...]
    max_samples_per_dataset: int | None
    device: str
    draft_cost_ratio: float


def parse_spec(spec: Mapping[str, Any]) -> EvalSpec:
    missing = [key for key in ("store", "draft_vocab") if not spec.get(key)]
    if missing:
        raise EvaluateError(f"evaluate spec: missing {', '.join(missing)} (expected folder paths)")
    steps = tuple(spec.get("steps") or DEFAULT_STEPS)
    if not all(isinstance(k, int) and 1 <= k <= 16 for k in steps):
        raise EvaluateError(f"evaluate spec: steps must be integers in 1..16, got {list(steps)}")
    cap = spec.get("max_samples_per_dataset")
    if cap is not None and (not isinstance(cap, int) or cap < 1):
        raise EvaluateError(f"evaluate spec: max_samples_per_dataset must be a positive integer or null, got {cap!r}")
    device = spec.get("device", "auto")
    if device not in ("auto", "cpu", "cuda"):
        raise EvaluateError(f"evaluate spec: device must be auto, cpu or cuda, got {device!r}")
    ratio = float(spec.get("draft_cost_ratio", DEFAULT_DRAFT_COST_RATIO))
    if not 0 <= ratio < 1:
        raise EvaluateError(f"evaluate spec: draft_cost_ratio must be in [0, 1), got {ratio}")
    return EvalSpec(
        store=Path(spec["store"]),
        draft_vocab=Path(spec["draft_vocab"]),
        drafter=Path(spec["drafter"]) if spec.get("drafter") else None,
        target_weights=Path(spec["target_weights"]) if spec.get("target_weights") else None,
        steps=tuple(sorted(set(steps))),
        max_samples_per_dataset=cap,
        device=device,
        draft_cost_ratio=ratio,
    )


def select_rows(store: HiddenStateStore, split: str, cap: int | None = None) -> list[dict[str, Any]]:
    """The index rows of a split in index order, at most ``cap`` per dataset."""
    taken: dict[str, int] = {}
    rows = []
    for row in store.index().to_pylist():
        if row["split"] != split or (cap is not None and taken.get(row["dataset"], 0) >= cap):
            continue
        taken[row["dataset"]] = taken.get(row["dataset"], 0) + 1
        rows.append(row)
    return rows


def read_rows(store: HiddenStateStore, rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """``(row, {key: tensor})`` for each row, reading only ``keys``; one shard open at a time."""
    from safetensors import safe_open

    by_shard: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_shard.setdefault(row["shard"], []).append(row)
    for shard, shard_rows in by_shard.items():
        path = store.root / f"{shard}.safetensors"
        if not path.is_file():
            raise StoreError(f"{path}: shard named in {store.index_path} is missing")
        with safe_open(str(path), framework="pt") as handle:
            slices = {key: handle.get_slice(key) for key in keys}
            for row in shard_rows:
                start, stop = row["offset"], row["offset"] + row["length"]
                yield row, {key: piece[start:stop] for key, piece in slices.items()}


def fit_store_bigram(store: HiddenStateStore, t2d: Any) -> BigramDrafter:
    """The bigram baseline counted over the store's train split (token ids and masks only)."""
    rows = select_rows(store, "train")
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


def add_drafter_batch(stats: AcceptanceStats, model: Any, aux: Any, input_ids: Any, loss_mask: Any, attention_mask: Any = None) -> None:
    """Draft a batch ([B, T, 3Ht], [B, T], [B, T]) ``max(stats.ks)`` deep and add each row to ``stats``.
    Right padding needs no trimming: padded positions have ``loss_mask`` 0. This is the call a training
    loop makes at each checkpoint to follow τ on its eval batches."""
    pred = drafter_predictions(model, aux, input_ids, stats.max_k, attention_mask)
    for row in range(pred.shape[0]):
        stats.add(pred[row], input_ids[row], loss_mask[row])


def speedup_estimate(tau: float, steps: int, draft_cost_ratio: float) -> float:
    """τ_K / (1 + K·c): tokens per verify step over the step's cost in target forwards (see module doc)."""
    return tau / (1 + steps * draft_cost_ratio)


def _pick_device(setting: str) -> Any:
    import torch

    if setting == "cuda" and not torch.cuda.is_available():
        raise EvaluateError("evaluate spec: device is cuda but torch sees no CUDA device")
    return torch.device("cuda" if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()) else "cpu")


def load_drafter(spec: EvalSpec, d2t: Any, aux_layer_ids: Sequence[int], device: Any) -> Any:
    """The exported drafter on ``device``; refuses one trained with another vocabulary or other layers."""
    import torch

    from eagle3_pipeline.drafter.export import load_export

    assert spec.drafter is not None
    model = load_export(spec.drafter, spec.target_weights)
    if model.d2t.shape != d2t.shape or not torch.equal(model.d2t.cpu(), d2t.to(torch.int64)):
        raise EvaluateError(
            f"{spec.drafter}: the drafter's d2t differs from {spec.draft_vocab} (draft vocab {tuple(model.d2t.shape)} vs "
            f"{tuple(d2t.shape)}); it was trained with another draft vocabulary, so the bigram comparison would be unfair"
        )
    if list(model.config.aux_layer_ids) != list(aux_layer_ids):
        raise EvaluateError(
            f"{spec.drafter}: trained on aux layers {list(model.config.aux_layer_ids)}, but {spec.store} holds layers {list(aux_layer_ids)}"
        )
    return model.to(device).eval()


def results_metadata(
    drafter: Mapping[str, AcceptanceStats] | None, bigram: Mapping[str, AcceptanceStats], draft_cost_ratio: float
) -> dict[str, Any]:
    """Flat numeric keys per dataset (``tau@K/<dataset>``, ``bigram_tau@K/<dataset>``, conditional rates,
    ``speedup_est@K/<dataset>``, ``eval_samples/<dataset>``…) plus ``table`` (markdown)."""
    out: dict[str, Any] = {}
    for dataset, stats in bigram.items():
        out[f"eval_samples/{dataset}"] = stats.samples
        out[f"eval_positions/{dataset}"] = stats.positions
    out.update(stats_metadata(BIGRAM, bigram))
    if drafter is not None:
        out.update(stats_metadata("", drafter))
        for dataset, stats in drafter.items():
            for k in stats.ks:
                out[f"speedup_est@{k}/{dataset}"] = round(speedup_estimate(stats.tau(k), k, draft_cost_ratio), 4)
    out["draft_cost_ratio"] = draft_cost_ratio
    out["table"] = summary_table(out)
    return out


def _depths(metadata: Mapping[str, Any]) -> list[int]:
    return sorted({int(key.split("@")[1].split("/")[0]) for key in metadata if key.startswith(f"{BIGRAM}tau@")})


def _datasets(metadata: Mapping[str, Any]) -> list[str]:
    names = sorted({key.split("/", 1)[1] for key in metadata if key.startswith("eval_samples/")} - {ALL})
    return [*names, ALL]


def summary_table(metadata: Mapping[str, Any]) -> str:
    """The main job's closing table (markdown, readable as plain text): dataset, samples, τ@K for each
    K, the bigram's τ@K, and the best estimated speedup with its K. Takes the flat metadata of
    :func:`results_metadata` (the ``drafter_eval`` materialization's values)."""
    ks = _depths(metadata)
    header = ["dataset", "samples", *[f"τ@{k}" for k in ks], "bigram τ@" + "/".join(map(str, ks)), "est. speedup"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for dataset in _datasets(metadata):
        taus = [metadata.get(f"tau@{k}/{dataset}") for k in ks]
        bigram = "/".join(f"{metadata[f'{BIGRAM}tau@{k}/{dataset}']:.2f}" for k in ks)
        speedups = {k: metadata[f"speedup_est@{k}/{dataset}"] for k in ks if f"speedup_est@{k}/{dataset}" in metadata}
        best = max(speedups, key=lambda k: speedups[k]) if speedups else None
        cells = [
            dataset,
            str(metadata.get(f"eval_samples/{dataset}", 0)),
            *["—" if tau is None else f"{tau:.2f}" for tau in taus],
            bigram,
            "—" if best is None else f"{speedups[best]:.2f}× (K={best})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tau_regressions(
    current: Mapping[str, float], previous: Mapping[str, float] | None, min_tau: float, max_drop: float
) -> list[str]:
    """What the blocking check reports: each drafter ``tau@K/<dataset>`` below ``min_tau``, or more than
    ``max_drop`` below the same key of the previous results (keys absent there are not compared)."""
    problems = []
    for key, tau in sorted(current.items()):
        if not key.startswith("tau@"):
            continue
        if tau < min_tau:
            problems.append(f"{key} = {tau:.3f} is below the floor {min_tau:g}")
        before = previous.get(key) if previous is not None else None
        if before is not None and tau < before - max_drop:
            problems.append(f"{key} fell from {before:.3f} to {tau:.3f} (more than {max_drop:g})")
    return problems


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
    bigram_model = fit_store_bigram(store, t2d)
    report.log(f"bigram baseline: {bigram_model.pairs} train pairs, {bigram_model.seen} tokens with a successor")
    rows = select_rows(store, "eval", settings.max_samples_per_dataset)
    if not rows:
        raise EvaluateError(f"{store.index_path}: no eval sample; the eval split is empty")
    device = _pick_device(settings.device)
    model = load_drafter(settings, d2t, manifest.aux_layer_ids, device) if settings.drafter is not None else None
    depth = max(settings.steps)
    keys = (IDS_KEY, MASK_KEY, AUX_KEY) if model is not None else (IDS_KEY, MASK_KEY)
    drafter_stats: dict[str, AcceptanceStats] = {}
    bigram_stats: dict[str, AcceptanceStats] = {}
    last_report = time.monotonic()
    for done, (row, tensors) in enumerate(read_rows(store, rows, keys), start=1):
        ids, mask = tensors[IDS_KEY].long(), tensors[MASK_KEY].bool()
        dataset = row["dataset"]
        bigram_stats.setdefault(dataset, AcceptanceStats(settings.steps)).add(bigram_model.predict(ids, depth), ids, mask)
        if model is not None:
            stats = drafter_stats.setdefault(dataset, AcceptanceStats(settings.steps))
            add_drafter_batch(stats, model, tensors[AUX_KEY][None].to(device), ids[None].to(device), mask[None])
        if time.monotonic() - last_report >= PROGRESS_EVERY_S or done == len(rows):
            last_report = time.monotonic()
            report.progress({"eval_samples_done": done, "eval_samples": len(rows)})
    if model is not None:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    metadata = results_metadata(
        with_total(drafter_stats, settings.steps) if drafter_stats else None, with_total(bigram_stats, settings.steps), settings.draft_cost_ratio
    )
    metadata["eval_seconds"] = round(time.monotonic() - started, 1)
    metadata["drafter"] = str(settings.drafter) if settings.drafter else "none (bigram baseline only)"
    report.log("acceptance on the eval split:\n" + metadata["table"])
    return metadata

