"""The ``evaluate`` heavy phase: τ of the trained drafter and of the bigram baseline on the eval split.

``run(spec, report)`` (``compute.PHASES["evaluate"]``) reads, where it runs:

- ``store``: the hidden-state store (C3): the eval split's aux states and tokens, and the train
  split's tokens for the bigram counts;
- ``draft_vocab``: ``d2t``/``t2d`` (C4), the vocabulary both drafters draft in;
- ``drafter``: the exported drafter folder (``export.load_export``); ``None`` evaluates the bigram
  baseline alone (e.g. before any training);
- ``target_weights``: the target model folder, read as the trainer reads it
  (:func:`~eagle3_pipeline.target_weights.load_target_weights` with ``embedding_key`` and
  ``lm_head_key``): its ``lm_head`` turns the store's final states into the target's argmax, and an
  export that leaves the embedding to the target takes it from there. ``None``: the data–target
  agreement and τ against the target's argmax are reported as not computed;
- ``held_out`` (dataset → ids, from ``training_data``'s manifest, :func:`held_out_spec`) and
  ``held_out_version`` (that manifest's version): the fixed held-out slice, evaluated on its own;
- ``steps`` (draft depths K, default 3, 5, 7), ``max_samples_per_dataset`` (the held-out ids are
  evaluated besides), ``device`` (auto|cpu|cuda), ``draft_cost_ratio`` (for the speedup estimate),
  ``min_data_agreement`` (the warning threshold, default 0.9).

Each eval sample runs one ``ttt_forward`` of ``max(steps)`` steps (chain drafts at depth j do not
depend on K, so K = 3 and 5 are the first depths of the same pass); ``draft_target_ids`` gives
``pred [K, T]`` for :mod:`eagle3_pipeline.drafter.acceptance`, and the bigram drafter fills the same
tensor from the same tokens. Both are walked twice: against the stored tokens and against the target's
argmax (definitions in :mod:`eagle3_pipeline.drafter.acceptance`), and the data–target agreement is
counted on the same positions.

Data–target agreement: the share of compared positions whose stored token is the target's argmax
(float32 ``argmax(hidden @ lm_head.T)``; a server computing bf16 logits can break a near-tie the other
way, one reason greedy data agree a little below 1). Below ``min_data_agreement`` a dataset gets a
warning (``data_agreement_warning``, also under the table): its responses are not the target's greedy
output, so τ against its stored tokens is not the τ a server would measure.

Speedup estimate (an estimate, not a measurement; ``drafter_benchmark`` measures): one verify step
costs K draft forwards and one target forward, which verifies K+1 tokens for about the price of one
in memory-bound decoding; it yields τ tokens. So speedup ≈ τ_K / (1 + K·c), with c the cost of a
draft forward relative to a target forward. The default c = 1/61 counts layers: one draft decoder
layer against a 61-layer target (the draft's fc and lm_head roughly offset the target's being MoE).

torch is imported inside the functions that need it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.dataprep.training_data import TrainingData, iter_rows
from eagle3_pipeline.drafter.acceptance import (
    ALL,
    AcceptanceStats,
    Agreement,
    stats_metadata,
    target_reference,
)
from eagle3_pipeline.drafter.bigram import BigramDrafter, fit_bigram
from eagle3_pipeline.hidden_states.plan import ROLLING_LAYOUT_FILE
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

DEFAULT_STEPS = (3, 5, 7)
DEFAULT_DRAFT_COST_RATIO = round(1 / 61, 4)
DEFAULT_MIN_DATA_AGREEMENT = 0.9
BIGRAM = "bigram_"
HELD_OUT = "held_out_"
VS_TARGET = "tau_vs_target@"
AGREEMENT = "data_agreement/"
WARNING = "data_agreement_warning"
TARGET_NOTE = "target_reference"
HELD_OUT_NOTE = "held_out"
NOT_COMPUTED = "not computed"
ARGMAX_CHUNK_TOKENS = 1024
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
    min_data_agreement: float = DEFAULT_MIN_DATA_AGREEMENT
    embedding_key: str | None = None
    lm_head_key: str | None = None
    held_out: dict[str, list[str]] | None = None
    held_out_version: str | None = None
    training_data: Path | None = None  # the bigram's counts for a rolling store, which keeps no train shard


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
    floor = float(spec.get("min_data_agreement", DEFAULT_MIN_DATA_AGREEMENT))
    if not 0 <= floor <= 1:
        raise EvaluateError(f"evaluate spec: min_data_agreement must be in [0, 1], got {floor}")
    held_out = spec.get("held_out")
    if held_out is not None and not (
        isinstance(held_out, Mapping)
        and all(isinstance(ids, list) and all(isinstance(i, str) for i in ids) for ids in held_out.values())
    ):
        raise EvaluateError(f"evaluate spec: held_out must map each dataset to a list of sample ids, got {held_out!r}")
    return EvalSpec(
        store=Path(spec["store"]),
        draft_vocab=Path(spec["draft_vocab"]),
        drafter=Path(spec["drafter"]) if spec.get("drafter") else None,
        target_weights=Path(spec["target_weights"]) if spec.get("target_weights") else None,
        steps=tuple(sorted(set(steps))),
        max_samples_per_dataset=cap,
        device=device,
        draft_cost_ratio=ratio,
        min_data_agreement=floor,
        embedding_key=spec.get("embedding_key"),
        lm_head_key=spec.get("lm_head_key"),
        held_out={dataset: list(ids) for dataset, ids in held_out.items()} if held_out is not None else None,
        held_out_version=spec.get("held_out_version"),
        training_data=Path(spec["training_data"]) if spec.get("training_data") else None,
    )


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

    from eagle3_pipeline.target_weights import load_target_weights

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


@dataclass
class Tally:
    """One group of eval samples (a dataset, its held-out ids, or ``all``): τ of the bigram baseline
    and of the drafter (None when none is evaluated) against the stored tokens and, when the target's
    lm_head was read, against its argmax (the ``*_vs_target`` stats and ``agreement``, None otherwise)."""

    bigram: AcceptanceStats
    drafter: AcceptanceStats | None
    bigram_vs_target: AcceptanceStats | None
    drafter_vs_target: AcceptanceStats | None
    agreement: Agreement | None

    @classmethod
    def empty(cls, ks: Sequence[int], drafter: bool, target: bool) -> Tally:
        def stats(wanted: bool) -> AcceptanceStats | None:
            return AcceptanceStats(tuple(ks)) if wanted else None

        return cls(
            AcceptanceStats(tuple(ks)),
            stats(drafter),
            stats(target),
            stats(drafter and target),
            Agreement() if target else None,
        )

    @property
    def samples(self) -> int:
        return self.bigram.samples

    def add(
        self, input_ids: Any, loss_mask: Any, bigram_pred: Any, drafter_pred: Any = None, reference: Any = None
    ) -> None:
        """One sample: the two drafters' ``pred [K, T]`` (``drafter_pred`` when a drafter is evaluated)
        and the target's reference (:func:`~eagle3_pipeline.drafter.acceptance.target_reference`) when
        its lm_head was read."""
        self.bigram.add(bigram_pred, input_ids, loss_mask)
        if self.drafter is not None:
            self.drafter.add(drafter_pred, input_ids, loss_mask)
        if self.agreement is not None:
            assert self.bigram_vs_target is not None
            self.agreement.add(input_ids, loss_mask, reference)
            self.bigram_vs_target.add(bigram_pred, input_ids, loss_mask, reference)
            if self.drafter_vs_target is not None:
                self.drafter_vs_target.add(drafter_pred, input_ids, loss_mask, reference)

    def merge(self, other: Tally) -> None:
        self.bigram.merge(other.bigram)
        pairs = (
            (self.drafter, other.drafter),
            (self.bigram_vs_target, other.bigram_vs_target),
            (self.drafter_vs_target, other.drafter_vs_target),
        )
        for mine, theirs in pairs:
            if mine is not None and theirs is not None:
                mine.merge(theirs)
        if self.agreement is not None and other.agreement is not None:
            self.agreement.merge(other.agreement)


def totals(groups: Mapping[str, Tally]) -> dict[str, Tally]:
    """The groups in name order, then their sum under ``all`` (nothing when there is no group)."""
    if not groups:
        return {}
    first = next(iter(groups.values()))
    total = Tally.empty(first.bigram.ks, first.drafter is not None, first.agreement is not None)
    for tally in groups.values():
        total.merge(tally)
    return {**dict(sorted(groups.items())), ALL: total}


def _rounded(agreement: Agreement | None) -> float | None:
    """The agreement as the metadata, the table and the warning all give it (4 decimals)."""
    rate = agreement.rate if agreement is not None else None
    return None if rate is None else round(rate, 4)


def _taus(prefix: str, results: Mapping[str, AcceptanceStats]) -> dict[str, float]:
    return {f"{prefix}{k}/{dataset}": round(stats.tau(k), 4) for dataset, stats in results.items() for k in stats.ks}


def _present(groups: Mapping[str, Tally], attribute: str) -> dict[str, Any]:
    return {dataset: getattr(t, attribute) for dataset, t in groups.items() if getattr(t, attribute) is not None}


def agreement_warnings(groups: Mapping[str, Tally], floor: float) -> list[str]:
    """One line per dataset (not ``all``) whose data–target agreement is below ``floor``, saying what
    it likely means and, with a drafter, its τ both ways at the deepest K."""
    lines = []
    for dataset, tally in groups.items():
        rate = _rounded(tally.agreement)
        if dataset == ALL or rate is None or rate >= floor:
            continue
        assert tally.agreement is not None
        figures = ""
        if tally.drafter is not None and tally.drafter_vs_target is not None:
            k = tally.drafter.max_k
            figures = (
                f" (τ@{k}: {tally.drafter.tau(k):.2f} against the stored tokens, "
                f"{tally.drafter_vs_target.tau(k):.2f} against the target's argmax)"
            )
        lines.append(
            f"{dataset}: the stored next token is the target's argmax at only {rate:.1%} of "
            f"{tally.agreement.positions} eval positions (drafter_eval.min_data_agreement {floor:g}). Its responses "
            "are likely not the target's greedy output: generated at temperature > 0, imported samples, or text "
            "re-tokenised since generation. τ against the stored tokens is then not the τ a server measures; τ "
            f"against the target's argmax is what a greedy verifier would accept on these contexts{figures}."
        )
    return lines


def results_metadata(
    groups: Mapping[str, Tally],
    held_out: Mapping[str, Tally],
    draft_cost_ratio: float,
    min_data_agreement: float = DEFAULT_MIN_DATA_AGREEMENT,
    notes: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``table`` (markdown, :func:`summary_table`) first, then ``data_agreement_warning`` when a dataset
    is below ``min_data_agreement``, then flat numeric keys per dataset (``tau@K/<dataset>``,
    ``tau_vs_target@K/…``, ``data_agreement/…``, ``bigram_tau@K/…``, conditional rates,
    ``speedup_est@K/…``, ``eval_samples/…``, the same under ``held_out_`` for the held-out slice) and
    ``notes`` (``target_reference``: where the target's argmax came from or why it is not computed;
    ``held_out``: what the held-out rows are or why there are none). ``groups`` and ``held_out`` are
    :func:`totals`' output."""
    out: dict[str, Any] = {}
    for dataset, tally in groups.items():
        out[f"eval_samples/{dataset}"] = tally.samples
        out[f"eval_positions/{dataset}"] = tally.bigram.positions
    for dataset, tally in groups.items():
        if _rounded(tally.agreement) is not None:
            out[f"{AGREEMENT}{dataset}"] = _rounded(tally.agreement)
    out.update(stats_metadata(BIGRAM, {dataset: t.bigram for dataset, t in groups.items()}))
    out.update(_taus(BIGRAM + VS_TARGET, _present(groups, "bigram_vs_target")))
    drafter = _present(groups, "drafter")
    out.update(stats_metadata("", drafter))
    out.update(_taus(VS_TARGET, _present(groups, "drafter_vs_target")))
    for dataset, stats in drafter.items():
        for k in stats.ks:
            out[f"speedup_est@{k}/{dataset}"] = round(speedup_estimate(stats.tau(k), k, draft_cost_ratio), 4)
    for dataset, tally in held_out.items():
        out[f"{HELD_OUT}samples/{dataset}"] = tally.samples
        if _rounded(tally.agreement) is not None:
            out[f"{HELD_OUT}{AGREEMENT}{dataset}"] = _rounded(tally.agreement)
    out.update(_taus(f"{HELD_OUT}tau@", _present(held_out, "drafter")))
    out.update(_taus(f"{HELD_OUT}{VS_TARGET}", _present(held_out, "drafter_vs_target")))
    out.update(_taus(f"{HELD_OUT}{BIGRAM}tau@", {dataset: t.bigram for dataset, t in held_out.items()}))
    out["draft_cost_ratio"] = draft_cost_ratio
    out["min_data_agreement"] = min_data_agreement
    out.update(notes or {})
    warnings = agreement_warnings(groups, min_data_agreement)
    head = {WARNING: "\n".join(warnings)} if warnings else {}
    return {"table": summary_table({**head, **out}), **head, **out}


def _depths(metadata: Mapping[str, Any]) -> list[int]:
    return sorted({int(key.split("@")[1].split("/")[0]) for key in metadata if key.startswith(f"{BIGRAM}tau@")})


def _datasets(metadata: Mapping[str, Any]) -> list[str]:
    names = sorted({key.split("/", 1)[1] for key in metadata if key.startswith("eval_samples/")} - {ALL})
    return [*names, ALL]


def _row(metadata: Mapping[str, Any], ks: Sequence[int], label: str, dataset: str, prefix: str) -> str:
    """One table row from the keys under ``prefix`` ("" or ``held_out_``); ``—`` for a figure absent."""

    def joined(key: str) -> str:
        values = [metadata.get(f"{key}{k}/{dataset}") for k in ks]
        return "—" if any(v is None for v in values) else "/".join(f"{v:.2f}" for v in values)

    taus = [metadata.get(f"{prefix}tau@{k}/{dataset}") for k in ks]
    agreement = metadata.get(f"{prefix}{AGREEMENT}{dataset}")
    speedups = {
        k: metadata[f"speedup_est@{k}/{dataset}"] for k in ks if not prefix and f"speedup_est@{k}/{dataset}" in metadata
    }
    best = max(speedups, key=lambda k: speedups[k]) if speedups else None
    cells = [
        label,
        str(metadata.get(f"{prefix or 'eval_'}samples/{dataset}", 0)),
        *["—" if tau is None else f"{tau:.2f}" for tau in taus],
        joined(f"{prefix}{VS_TARGET}"),
        "—" if agreement is None else f"{agreement:.1%}",
        joined(f"{prefix}{BIGRAM}tau@"),
        "—" if best is None else f"{speedups[best]:.2f}× (K={best})",
    ]
    return "| " + " | ".join(cells) + " |"


def summary_table(metadata: Mapping[str, Any]) -> str:
    """The main job's closing table (markdown, readable as plain text): dataset, samples, τ@K for each
    K against the stored tokens, τ@K against the target's argmax, the data–target agreement, the
    bigram's τ@K, and the best estimated speedup with its K; a ``<dataset> held-out`` row under each
    dataset with a held-out slice; then the warnings and what could not be computed. Takes the flat
    metadata of :func:`results_metadata` (the ``drafter_eval`` materialization's values)."""
    ks = _depths(metadata)
    depths = "/".join(map(str, ks))
    header = [
        "dataset",
        "samples",
        *[f"τ@{k}" for k in ks],
        f"τ vs target@{depths}",
        "agreement",
        f"bigram τ@{depths}",
        "est. speedup",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    held = False
    for dataset in _datasets(metadata):
        lines.append(_row(metadata, ks, dataset, dataset, ""))
        if f"{HELD_OUT}samples/{dataset}" in metadata:
            held = True
            lines.append(_row(metadata, ks, f"{dataset} held-out", dataset, HELD_OUT))
    notes = [f"warning: {line}" for line in str(metadata.get(WARNING, "")).splitlines()]
    reference = str(metadata.get(TARGET_NOTE, ""))
    if reference.startswith(NOT_COMPUTED):
        notes.append(f"τ vs target and agreement: {reference}")
    if metadata.get(HELD_OUT_NOTE):
        notes.append(f"{'held-out rows' if held else 'held-out'}: {metadata[HELD_OUT_NOTE]}")
    return "\n".join([*lines, *([""] + notes if notes else [])])


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
