"""Training batches from the hidden-state store, with bounded memory and a resumable position.

An epoch's batches (which samples go into which batch, in which order) are a pure function of the
store's index, the seed and the epoch number: shard order shuffled, samples shuffled within each
shard, then packed greedily into batches of at most ``batch_tokens`` padded tokens. Only the index is
read to batch; tensors are read batch by batch with at most one shard file open, so a resumed run
recomputes the batch order and continues at ``(epoch, batch)`` without touching the data it skips.

Teacher signal (as in SpecForge's training): the target's logits at index t are ``lm_head(hidden_states[t])``
(final hidden after the final norm); :func:`teacher` turns them into the target's distribution over
the draft vocabulary and its full-vocabulary argmax.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_pipeline.hidden_states.store import AUX_KEY, HIDDEN_KEY, IDS_KEY, MASK_KEY, HiddenStateStore, ShardFile

TEACHER_CHUNK_TOKENS = 1024


@dataclass(frozen=True)
class Row:
    shard: str
    offset: int
    length: int


@dataclass
class Batch:
    """Padded tensors [B, T, ...]; ``attention_mask`` marks real tokens."""

    aux: torch.Tensor
    hidden: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device) -> Batch:
        return Batch(
            *(
                t.to(device, non_blocking=True)
                for t in (self.aux, self.hidden, self.input_ids, self.loss_mask, self.attention_mask)
            )
        )


def store_rows(store: HiddenStateStore, split: str) -> list[Row]:
    """The index rows of one split (samples shorter than 3 tokens train nothing and are left out)."""
    table = store.index().select(["split", "shard", "offset", "length"]).to_pylist()
    return [Row(r["shard"], r["offset"], r["length"]) for r in table if r["split"] == split and r["length"] >= 3]


def epoch_batches(
    rows: Sequence[Row], seed: int, epoch: int | str, batch_tokens: int, max_seq_len: int
) -> list[list[Row]]:
    """The batches of one epoch (deterministic in seed and epoch; a rolling window's ``epoch/window``)."""
    rng = random.Random(f"{seed}:{epoch}")
    by_shard: dict[str, list[Row]] = {}
    for row in rows:
        by_shard.setdefault(row.shard, []).append(row)
    shards = sorted(by_shard)
    rng.shuffle(shards)
    batches: list[list[Row]] = []
    current: list[Row] = []
    longest = 0
    for shard in shards:
        members = list(by_shard[shard])
        rng.shuffle(members)
        for row in members:
            length = min(row.length, max_seq_len)
            if current and (len(current) + 1) * max(longest, length) > batch_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append(row)
            longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


class BatchReader:
    """Reads the rows of a batch from the shard files, keeping only the last shard open (states in
    bf16 whatever the store's storage dtype: :class:`ShardFile` dequantizes fp8)."""

    def __init__(self, root: Path, max_seq_len: int) -> None:
        self.root = Path(root)
        self.max_seq_len = max_seq_len
        self._name: str | None = None
        self._shard: ShardFile | None = None

    def _open(self, shard: str) -> ShardFile:
        if self._shard is None or shard != self._name:
            self.close()
            self._shard = ShardFile(self.root / f"{shard}.safetensors")
            self._name = shard
        return self._shard

    def close(self) -> None:
        self._shard, self._name = None, None

    def read(self, rows: Sequence[Row]) -> Batch:
        samples = []
        for row in rows:
            s = self._open(row.shard)
            start, stop = row.offset, row.offset + min(row.length, self.max_seq_len)
            samples.append(tuple(s.read(key, start, stop) for key in (AUX_KEY, HIDDEN_KEY, IDS_KEY, MASK_KEY)))
        width = max(sample[2].shape[0] for sample in samples)
        b = len(samples)
        aux = torch.zeros(b, width, samples[0][0].shape[1], dtype=samples[0][0].dtype)
        hidden = torch.zeros(b, width, samples[0][1].shape[1], dtype=samples[0][1].dtype)
        ids = torch.zeros(b, width, dtype=torch.long)
        mask = torch.zeros(b, width, dtype=torch.bool)
        attn = torch.zeros(b, width, dtype=torch.bool)
        for i, (a, h, x, m) in enumerate(samples):
            n = x.shape[0]
            aux[i, :n], hidden[i, :n], ids[i, :n], mask[i, :n], attn[i, :n] = a, h, x.long(), m.bool(), True
        return Batch(aux, hidden, ids, mask, attn)

    def batches(self, batches: Sequence[Sequence[Row]], start: int = 0) -> Iterator[tuple[int, Batch]]:
        for index in range(start, len(batches)):
            yield index, self.read(batches[index])


@dataclass
class Teacher:
    """Per index t: ``probs`` [B, T, Vd] the target's next-token distribution renormalised over the
    draft vocabulary, ``argmax`` [B, T] its full-vocabulary argmax (a target id)."""

    probs: torch.Tensor
    argmax: torch.Tensor


@torch.no_grad()
def teacher(
    hidden: torch.Tensor, lm_head: torch.Tensor, t2d: torch.Tensor, needed: torch.Tensor | None = None
) -> Teacher:
    """Target logits = ``hidden @ lm_head.T`` (computed in chunks of tokens for the full argmax).

    ``needed`` [B, T] (bool) limits the work to the indices whose prediction is trained (the rest of
    ``probs`` is 0 and of ``argmax`` 0): the full-vocabulary product costs more than the drafter's own
    step, and prompt, template and padding indices never reach the loss."""
    b, t, h = hidden.shape
    flat = hidden.reshape(b * t, h)
    where = None if needed is None else needed.reshape(b * t).nonzero().squeeze(1)
    rows = flat if where is None else flat.index_select(0, where)
    draft_head = lm_head[t2d]
    picked_argmax = torch.empty(rows.shape[0], dtype=torch.long, device=hidden.device)
    picked_probs = torch.empty(rows.shape[0], draft_head.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, rows.shape[0], TEACHER_CHUNK_TOKENS):
        chunk = rows[start : start + TEACHER_CHUNK_TOKENS].to(lm_head.dtype)
        picked_argmax[start : start + chunk.shape[0]] = (chunk @ lm_head.T).argmax(-1)
        picked_probs[start : start + chunk.shape[0]] = torch.softmax((chunk @ draft_head.T).float(), dim=-1)
    if where is None:
        return Teacher(picked_probs.view(b, t, -1), picked_argmax.view(b, t))
    argmax = torch.zeros(b * t, dtype=torch.long, device=hidden.device).index_copy_(0, where, picked_argmax)
    probs = torch.zeros(b * t, draft_head.shape[0], dtype=torch.float32, device=hidden.device).index_copy_(
        0, where, picked_probs
    )
    return Teacher(probs.view(b, t, -1), argmax.view(b, t))
