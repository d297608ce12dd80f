"""The bigram drafter: the baseline every trained drafter must beat.

Counts pairs ``(x_p, x_{p+1})`` over the TRAIN split where ``x_{p+1}`` is target-generated
(``loss_mask``) and in the draft vocabulary (``t2d``), so it proposes only what the trained drafter
could propose. For each target token it keeps the most frequent successor (ties: the smaller id);
a token never seen as a predecessor gets the most frequent draft token overall.

Drafting is greedy and chain-wise, as a server would run it: from position ``t`` (the target just
produced ``x_{t+1}``) depth 0 is ``next[x_{t+1}]`` and depth ``j`` is ``next[depth j-1]``. The result
is the ``pred [K, T]`` tensor of :mod:`eagle3_pipeline.drafter.evaluate.acceptance`.

numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

FLUSH_PAIRS = 8_000_000


class BigramError(ValueError):
    """No usable training pair, or inputs of the wrong shape."""


def _array(value: Any, dtype: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value).astype(dtype, copy=False)


@dataclass(frozen=True)
class BigramDrafter:
    next_token: np.ndarray  # [V] int64: the draft-vocab successor proposed after each target token
    pairs: int  # training pairs counted
    seen: int  # target tokens with at least one counted successor

    def predict(self, input_ids: Any, steps: int) -> np.ndarray:
        """``pred [steps, T]``: ``pred[j, t]`` is the depth-``j`` draft after ``x_{t+1}`` (chain-wise)."""
        ids = _array(input_ids, np.int64)
        if ids.ndim != 1 or ids.shape[0] == 0:
            raise BigramError(f"expected input_ids [T] with T > 0, got shape {list(ids.shape)}")
        current = np.concatenate([ids[1:], ids[-1:]])
        out = np.empty((steps, ids.shape[0]), dtype=np.int64)
        for depth in range(steps):
            current = self.next_token[current]
            out[depth] = current
        return out


class _PairCounter:
    """Sparse pair counts as sorted unique keys ``prev * V + next`` with counts, merged in chunks."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.keys = np.empty(0, dtype=np.int64)
        self.counts = np.empty(0, dtype=np.int64)
        self._pending: list[np.ndarray] = []
        self._pending_size = 0
        self.pairs = 0

    def add(self, keys: np.ndarray) -> None:
        self._pending.append(keys)
        self._pending_size += keys.shape[0]
        self.pairs += keys.shape[0]
        if self._pending_size >= FLUSH_PAIRS:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        new_keys, new_counts = np.unique(np.concatenate(self._pending), return_counts=True)
        merged_keys, inverse = np.unique(np.concatenate([self.keys, new_keys]), return_inverse=True)
        self.counts = np.bincount(
            inverse, weights=np.concatenate([self.counts, new_counts]), minlength=merged_keys.shape[0]
        ).astype(np.int64)
        self.keys = merged_keys
        self._pending, self._pending_size = [], 0


def fit_bigram(sequences: Iterable[tuple[Any, Any]], t2d: Any) -> BigramDrafter:
    """Count ``(input_ids, loss_mask)`` sequences of the train split; ``t2d`` is the bool [V] draft mask."""
    in_draft = _array(t2d, bool)
    vocab_size = in_draft.shape[0]
    counter = _PairCounter(vocab_size)
    for input_ids, loss_mask in sequences:
        ids = _array(input_ids, np.int64)
        mask = _array(loss_mask, bool)
        if ids.shape != mask.shape or ids.ndim != 1:
            raise BigramError(f"input_ids {list(ids.shape)} and loss_mask {list(mask.shape)} differ")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise BigramError(
                f"token id outside the target vocabulary of {vocab_size} (min {ids.min()}, max {ids.max()})"
            )
        prev, nxt = ids[:-1], ids[1:]
        keep = mask[1:] & in_draft[nxt]
        counter.add(prev[keep] * vocab_size + nxt[keep])
    counter.flush()
    if counter.pairs == 0:
        raise BigramError("no target-generated token of the train split is in the draft vocabulary; nothing to count")
    prev, nxt = np.divmod(counter.keys, vocab_size)
    unigram = np.bincount(nxt, weights=counter.counts, minlength=vocab_size)
    fallback = int(np.argmax(unigram))
    order = np.lexsort((nxt, -counter.counts, prev))
    prev, nxt = prev[order], nxt[order]
    first = np.concatenate([[True], prev[1:] != prev[:-1]])
    next_token = np.full(vocab_size, fallback, dtype=np.int64)
    next_token[prev[first]] = nxt[first]
    return BigramDrafter(next_token=next_token, pairs=int(counter.pairs), seen=int(first.sum()))
