"""Acceptance length τ of a chain drafter, computed the way a greedy speculative server accepts.

``pred[j, t]`` is the target token id the drafter proposes at depth ``j`` when it drafts from position
``t`` (TTT step ``j`` at index ``t``; the bigram drafter fills the same tensor); a reference ``r`` is the
token a greedy verifier accepts at each position: the response's own tokens, or the target's argmax
(:func:`target_reference`). From them: the server-faithful τ, the per-position estimate, the
conditional acceptance per depth, and the data–target agreement (:class:`Agreement`). The definitions
and why they are the server's: drafter/DESIGN.md, "Acceptance length τ". numpy only; torch tensors are
accepted (moved to the CPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ALL = "all"


class AcceptanceInputError(ValueError):
    """Prediction and token tensors that do not fit together."""


def _array(value: Any, dtype: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value).astype(dtype, copy=False)


def response_spans(loss_mask: Any) -> list[tuple[int, int]]:
    """The maximal runs ``[s, e)`` of ``loss_mask == 1``: one per generated response."""
    mask = _array(loss_mask, bool)
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.diff(padded)
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist(), strict=True))


@dataclass(frozen=True)
class SampleAcceptance:
    """One sample's per-position outcome at depth ``K = pred.shape[0]``.

    ``accepted[t]`` = a(t) for eligible ``t`` (-1 elsewhere); ``matches[j, t]`` = c_j(t);
    ``inside[j, t]`` = the depth-``j`` target of ``t`` is inside ``t``'s response.
    """

    accepted: np.ndarray
    matches: np.ndarray
    inside: np.ndarray
    spans: list[tuple[int, int]]

    @property
    def eligible(self) -> np.ndarray:
        return self.accepted >= 0


def target_reference(input_ids: Any, next_argmax: Any) -> np.ndarray:
    """The reference ``r_i = g_i`` from ``next_argmax [T]``, the target's argmax at each position
    (``next_argmax[p]`` is its greedy choice for ``x_{p+1}``): ``r = [x_0, next_argmax[0 … T-2]]``
    (``r_0`` is never compared with a draft)."""
    tokens = _array(input_ids, np.int64)
    argmax = _array(next_argmax, np.int64)
    if tokens.ndim != 1 or argmax.shape != tokens.shape:
        raise AcceptanceInputError(
            f"expected input_ids [T] and next_argmax [T]; got {list(tokens.shape)} and {list(argmax.shape)}"
        )
    return np.concatenate([tokens[:1], argmax[:-1]])


def _checked(tokens: np.ndarray, mask: np.ndarray, reference: Any) -> np.ndarray:
    if tokens.ndim != 1 or mask.shape != tokens.shape:
        raise AcceptanceInputError(
            f"expected input_ids [T] and loss_mask [T]; got {list(tokens.shape)} and {list(mask.shape)}"
        )
    if reference is None:
        return tokens
    ref = _array(reference, np.int64)
    if ref.shape != tokens.shape:
        raise AcceptanceInputError(
            f"the reference must be [T] like input_ids {list(tokens.shape)}; got {list(ref.shape)}"
        )
    return ref


def _span_ids(spans: Sequence[tuple[int, int]], size: int) -> np.ndarray:
    span_id = np.full(size, -1, dtype=np.int64)
    for number, (start, end) in enumerate(spans):
        span_id[start:end] = number
    return span_id


def compared_positions(loss_mask: Any) -> np.ndarray:
    """The positions ``i = t+2`` of every eligible ``t`` (see module doc): the tokens τ compares a
    depth-0 draft with, which are the positions :class:`Agreement` counts."""
    mask = _array(loss_mask, bool)
    span_id = _span_ids(response_spans(mask), mask.shape[0] + 2)
    t = np.arange(mask.shape[0])
    own = span_id[t + 1]
    return np.flatnonzero((own >= 0) & (span_id[t + 2] == own)) + 2


def sample_acceptance(pred: Any, input_ids: Any, loss_mask: Any, reference: Any = None) -> SampleAcceptance:
    """c_j(t), a(t) and the responses of one sample; ``pred`` is ``[K, T]`` target ids, ``reference``
    ``[T]`` the accepted token per position (None: the stored ``input_ids``; see module doc)."""
    drafts = _array(pred, np.int64)
    tokens = _array(input_ids, np.int64)
    mask = _array(loss_mask, bool)
    if drafts.ndim != 2 or tokens.ndim != 1 or mask.shape != tokens.shape or drafts.shape[1] != tokens.shape[0]:
        raise AcceptanceInputError(
            f"expected pred [K, T] with input_ids [T] and loss_mask [T]; got pred {list(drafts.shape)}, "
            f"input_ids {list(tokens.shape)}, loss_mask {list(mask.shape)}"
        )
    ref = _checked(tokens, mask, reference)
    depth, length = drafts.shape
    if depth < 1:
        raise AcceptanceInputError("pred has no draft depth (K = 0)")
    spans = response_spans(mask)
    span_id = _span_ids(spans, length + depth + 2)
    padded_ref = np.concatenate([ref, np.full(depth + 2, -1, dtype=np.int64)])
    t = np.arange(length)
    own = span_id[t + 1]
    inside = np.stack([(span_id[t + 2 + j] == own) & (own >= 0) for j in range(depth)])
    matches = np.stack([(drafts[j] == padded_ref[t + 2 + j]) & inside[j] for j in range(depth)])
    leading = np.cumprod(matches, axis=0).sum(axis=0)
    eligible = (own >= 0) & (span_id[t + 2] == own)
    accepted = np.where(eligible, leading, -1)
    return SampleAcceptance(accepted=accepted, matches=matches, inside=inside, spans=spans)


@dataclass
class Agreement:
    """Data–target agreement summed over samples: of the ``positions`` τ compares drafts with, how many
    hold the target's argmax (``agreeing``)."""

    positions: int = 0
    agreeing: int = 0

    def add(self, input_ids: Any, loss_mask: Any, reference: Any) -> None:
        tokens = _array(input_ids, np.int64)
        mask = _array(loss_mask, bool)
        ref = _checked(tokens, mask, reference)
        where = compared_positions(mask)
        self.positions += int(where.shape[0])
        self.agreeing += int((tokens[where] == ref[where]).sum())

    def merge(self, other: Agreement) -> None:
        self.positions += other.positions
        self.agreeing += other.agreeing

    @property
    def rate(self) -> float | None:
        """``agreeing / positions``; None when no position was compared (nothing to measure)."""
        return self.agreeing / self.positions if self.positions else None


def walk(accepted: np.ndarray, spans: Sequence[tuple[int, int]], steps: int) -> tuple[int, int]:
    """(verify steps, tokens emitted) of greedy chain drafting with ``steps`` drafts per step.

    A step emits ``1 + a`` tokens, except when it accepts everything left of the response: then there
    is no bonus token after the last one (the request ends), so every response of length ``L``
    emits exactly ``L - 1`` tokens over its steps (its first token comes from prefill).
    """
    count = emitted = 0
    for start, end in spans:
        t = max(start - 1, 0)  # a response at position 0 has no state before it: its first token is not drafted
        while t + 2 < end:
            a = min(int(accepted[t]), steps)
            count += 1
            emitted += min(1 + a, end - t - 2)
            t += a + 1
    return count, emitted


@dataclass
class AcceptanceStats:
    """Sums over samples for the depths ``ks``; ``add`` one sample at a time, read τ at the end."""

    ks: tuple[int, ...]
    samples: int = 0
    responses: int = 0
    positions: int = 0
    walk_steps: dict[int, int] = field(default_factory=dict)
    walk_tokens: dict[int, int] = field(default_factory=dict)
    position_accepted: dict[int, int] = field(default_factory=dict)
    reached: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.ks or min(self.ks) < 1:
            raise AcceptanceInputError(f"draft depths must be positive integers, got {list(self.ks)}")
        self.ks = tuple(sorted(set(self.ks)))
        for k in self.ks:
            self.walk_steps.setdefault(k, 0)
            self.walk_tokens.setdefault(k, 0)
            self.position_accepted.setdefault(k, 0)
        self.reached = self.reached or [0] * self.max_k
        self.hits = self.hits or [0] * self.max_k

    @property
    def max_k(self) -> int:
        return max(self.ks)

    def add(self, pred: Any, input_ids: Any, loss_mask: Any, reference: Any = None) -> None:
        """One sample; ``pred`` has at least ``max(ks)`` depths (extra depths are ignored); ``reference``
        as in :func:`sample_acceptance`."""
        drafts = _array(pred, np.int64)
        if drafts.ndim != 2 or drafts.shape[0] < self.max_k:
            raise AcceptanceInputError(f"pred needs [K >= {self.max_k}, T] depths, got {list(drafts.shape)}")
        result = sample_acceptance(drafts[: self.max_k], input_ids, loss_mask, reference)
        eligible = result.eligible
        self.samples += 1
        self.responses += len(result.spans)
        self.positions += int(eligible.sum())
        for k in self.ks:
            steps, tokens = walk(result.accepted, result.spans, k)
            self.walk_steps[k] += steps
            self.walk_tokens[k] += tokens
            self.position_accepted[k] += int(np.minimum(result.accepted[eligible], k).sum())
        prefix = eligible.copy()
        for j in range(self.max_k):
            reached = prefix & result.inside[j]
            self.reached[j] += int(reached.sum())
            self.hits[j] += int((reached & result.matches[j]).sum())
            prefix &= result.matches[j]

    def merge(self, other: AcceptanceStats) -> None:
        if other.ks != self.ks:
            raise AcceptanceInputError(f"cannot merge stats for depths {list(other.ks)} into {list(self.ks)}")
        self.samples += other.samples
        self.responses += other.responses
        self.positions += other.positions
        for k in self.ks:
            self.walk_steps[k] += other.walk_steps[k]
            self.walk_tokens[k] += other.walk_tokens[k]
            self.position_accepted[k] += other.position_accepted[k]
        self.reached = [a + b for a, b in zip(self.reached, other.reached, strict=True)]
        self.hits = [a + b for a, b in zip(self.hits, other.hits, strict=True)]

    def tau(self, k: int) -> float:
        """Server-faithful τ at depth ``k`` (1.0 when nothing was drafted)."""
        return self.walk_tokens[k] / self.walk_steps[k] if self.walk_steps[k] else 1.0

    def tau_per_position(self, k: int) -> float:
        return 1.0 + self.position_accepted[k] / self.positions if self.positions else 1.0

    def conditional_rates(self) -> list[float | None]:
        """P(c_j | c_<j) for j = 0 … max(ks)-1; None where no position reached depth j."""
        return [hit / reach if reach else None for hit, reach in zip(self.hits, self.reached, strict=True)]


def with_total(per_dataset: Mapping[str, AcceptanceStats], ks: Sequence[int]) -> dict[str, AcceptanceStats]:
    """The datasets in name order, then their sum under ``all``."""
    total = AcceptanceStats(tuple(ks))
    for stats in per_dataset.values():
        total.merge(stats)
    return {**dict(sorted(per_dataset.items())), ALL: total}


def evaluate(ks: Sequence[int], samples: Iterable[tuple[str, Any, Any, Any]]) -> dict[str, AcceptanceStats]:
    """``samples`` yields ``(dataset, pred, input_ids, loss_mask)``; returns stats per dataset and ``all``."""
    per_dataset: dict[str, AcceptanceStats] = {}
    for dataset, pred, input_ids, loss_mask in samples:
        per_dataset.setdefault(dataset, AcceptanceStats(tuple(ks))).add(pred, input_ids, loss_mask)
    return with_total(per_dataset, ks)


def stats_metadata(prefix: str, results: Mapping[str, AcceptanceStats]) -> dict[str, float | int]:
    """Flat numeric keys (one per dataset, plotted by the UI over materializations):
    ``{prefix}tau@K/<dataset>``, ``{prefix}tau_position@K/<dataset>``, ``{prefix}accept_d<j>/<dataset>``."""
    out: dict[str, float | int] = {}
    for dataset, stats in results.items():
        for k in stats.ks:
            out[f"{prefix}tau@{k}/{dataset}"] = round(stats.tau(k), 4)
            out[f"{prefix}tau_position@{k}/{dataset}"] = round(stats.tau_per_position(k), 4)
        for depth, rate in enumerate(stats.conditional_rates(), start=1):
            if rate is not None:
                out[f"{prefix}accept_d{depth}/{dataset}"] = round(rate, 4)
    return out


def served_tau_bound(per_position: Sequence[float], verify_steps: int, requests: int) -> float:
    """How far a server's τ (from its per-position acceptance rates P(accepted ≥ p + 1) over
    ``verify_steps`` steps of ``requests`` greedy requests) may lie from the offline τ of the same drafter
    on the same prompts: 3·√2 standard errors of the mean accepted drafts per step (two estimates of one
    mean), plus the last step of each request, whose K drafts a server schedules in full and counts
    accepted past the end of the response (``requests``·K·P(accept) / steps). drafter/DESIGN.md,
    "Acceptance length τ"."""
    if verify_steps <= 0 or not per_position:
        raise AcceptanceInputError(f"served_tau_bound: {verify_steps} verify steps, {len(per_position)} positions")
    mean = sum(per_position)  # E[accepted drafts per step] = Σ_p P(accepted ≥ p + 1)
    second_moment = sum((2 * p + 1) * rate for p, rate in enumerate(per_position))  # E[a²] = Σ_p (2p+1)·P(a > p)
    error = (max(second_moment - mean**2, 0.0) / verify_steps) ** 0.5
    return 3 * 2**0.5 * error + requests * len(per_position) * per_position[0] / verify_steps
