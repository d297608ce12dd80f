"""What the ``evaluate`` phase reports: τ per group of eval samples (:class:`Tally`, :func:`totals`),
as flat metadata with the agreement warnings (:func:`results_metadata`), as the main job's closing
table (:func:`summary_table`), and the blocking check's regressions (:func:`tau_regressions`). The
speedup estimate and the agreement warning's meaning: drafter/DESIGN.md "Evaluation"."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.drafter.evaluate.acceptance import (
    ALL,
    AcceptanceStats,
    Agreement,
    stats_metadata,
)

BIGRAM = "bigram_"
HELD_OUT = "held_out_"
VS_TARGET = "tau_vs_target@"
AGREEMENT = "data_agreement/"
WARNING = "data_agreement_warning"
TARGET_NOTE = "target_reference"
HELD_OUT_NOTE = "held_out"
NOT_COMPUTED = "not computed"


def speedup_estimate(tau: float, steps: int, draft_cost_ratio: float) -> float:
    """τ_K / (1 + K·c): tokens per verify step over the step's cost in target forwards
    (drafter/DESIGN.md "Evaluation")."""
    return tau / (1 + steps * draft_cost_ratio)


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
        and the target's reference (:func:`~eagle3_pipeline.drafter.evaluate.acceptance.target_reference`) when
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
    min_data_agreement: float,
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
