"""The training-time test's causal attention, blockwise (flash-attention style in plain PyTorch): its
memory is linear in the sequence length, never a T×T score tensor, forward and backward.

:class:`BlockCausalAttention` also returns each row's log-sum-exp, so the chain-drafting keys of
later steps merge into it exactly (:meth:`eagle3_pipeline.drafter.model.eagle3.Eagle3Drafter.ttt_forward`).
"""

from __future__ import annotations

from typing import Any

import torch

# The training-time test's causal attention takes ATTENTION_BLOCK query rows at a time, against key
# blocks of at most ATTENTION_SCORE_ELEMENTS scores (B · heads · query rows · key rows; at least
# ATTENTION_BLOCK key rows): one block's scores are the largest tensors it holds, whatever T.
ATTENTION_BLOCK = 512
ATTENTION_SCORE_ELEMENTS = 1 << 26
_MASKED = torch.finfo(torch.float32).min


def _query_blocks(length: int) -> list[tuple[int, int]]:
    return [(start, min(start + ATTENTION_BLOCK, length)) for start in range(0, length, ATTENTION_BLOCK)]


def _key_blocks(q_end: int, width: int) -> list[tuple[int, int]]:
    """Key blocks covering keys 0..q_end-1 for ``width`` = B · heads · query rows: as long as the
    score budget allows, in multiples of ATTENTION_BLOCK."""
    size = max(ATTENTION_BLOCK, ATTENTION_SCORE_ELEMENTS // width // ATTENTION_BLOCK * ATTENTION_BLOCK)
    return [(start, min(start + size, q_end)) for start in range(0, q_end, size)]


def _block_scores(
    q: torch.Tensor, k: torch.Tensor, q_start: int, k_start: int, keys_visible: torch.Tensor | None
) -> torch.Tensor:
    """float32 scores [B, nkv, g, bq, bk] of the scaled queries q [B, nkv, g, bq, hd] at q_start.. against
    keys k [B, nkv, bk, hd] at k_start..; keys after the query, or not visible (padding), get the float32
    minimum (as a full-score pass's masked_fill: zero weight, and a row with no key left averages)."""
    scores = torch.einsum("bngqd,bnkd->bngqk", q, k).float()
    if k_start + k.shape[2] - 1 > q_start:  # the causal edge crosses this block
        q_pos = torch.arange(q_start, q_start + q.shape[3], device=q.device)
        k_pos = torch.arange(k_start, k_start + k.shape[2], device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], _MASKED)
    if keys_visible is not None:
        scores.masked_fill_(~keys_visible[:, None, None, None, k_start : k_start + k.shape[2]], _MASKED)
    return scores


def _softmax_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    keys: tuple[int, int],
    keys_visible: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key block's softmax pieces for the query block q: row maxima m, Σ exp(s − m), Σ exp(s − m)·v."""
    k_start, k_end = keys
    scores = _block_scores(q, k[:, :, k_start:k_end], q_start, k_start, keys_visible)
    peak = scores.amax(-1)
    weights = scores.sub_(peak[..., None]).exp_()
    return peak, weights.sum(-1), torch.einsum("bngqk,bnkd->bngqd", weights.to(v.dtype), v[:, :, k_start:k_end]).float()


class BlockCausalAttention(torch.autograd.Function):
    """Causal attention over the visible keys and its per-row log-sum-exp, flash-attention style in
    plain PyTorch: :data:`ATTENTION_BLOCK` query rows at a time, an online softmax over the key blocks
    up to the query block's end (:func:`_key_blocks`). Forward and backward hold O(T · head_dim) per
    head plus one block's scores, never a T×T tensor.

    q [B, nkv, g, T, hd] (the g query heads of each KV head), k [B, nkv, T, hd] and v [B, nkv, T, hv]
    (hv may differ from hd: the MLA head's values are narrower than its keys), keys_visible [B, T] bool
    or None (all visible). Returns out [B, nkv, g, T, hv] and lse [B, nkv, g, T] float32. Backward takes
    the gradients of both: with P the attention weights and D = rowsum(dO ∘ O), dS = P ∘ (dP − D + dlse)
    since ∂lse/∂S = P. Scores, softmax statistics and gradient sums are float32; matmuls run in the
    inputs' dtype (autocast off inside: the backward needs the forward's dtypes, whichever thread runs it).
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys_visible: torch.Tensor | None, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(q.device.type, enabled=False):
            scaled = q * scale
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
            for q_start, q_end in _query_blocks(q.shape[3]):
                qb = scaled[:, :, :, q_start:q_end]
                first, *rest = _key_blocks(q_end, qb[..., 0].numel())
                peak, total, acc = _softmax_block(qb, k, v, q_start, first, keys_visible)
                for block in rest:  # merge the block's softmax into the running one
                    block_peak, block_total, block_acc = _softmax_block(qb, k, v, q_start, block, keys_visible)
                    new_peak = torch.maximum(peak, block_peak)
                    old_weight, block_weight = torch.exp(peak - new_peak), torch.exp(block_peak - new_peak)
                    total = total * old_weight + block_total * block_weight
                    acc = acc * old_weight[..., None] + block_acc * block_weight[..., None]
                    peak = new_peak
                out[:, :, :, q_start:q_end] = (acc / total[..., None]).to(q.dtype)
                lse[:, :, :, q_start:q_end] = peak + total.log()
        ctx.save_for_backward(q, k, v, out, lse, keys_visible)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, keys_visible = ctx.saved_tensors
        scale = ctx.scale
        with torch.autocast(q.device.type, enabled=False):
            scaled = q * scale
            grad_out = grad_out.to(q.dtype)
            delta = (grad_out.float() * out.float()).sum(-1) - grad_lse
            d_scaled = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
            for q_start, q_end in _query_blocks(q.shape[3]):
                qb, gb = scaled[:, :, :, q_start:q_end], grad_out[:, :, :, q_start:q_end]
                lse_b, delta_b = lse[:, :, :, q_start:q_end, None], delta[:, :, :, q_start:q_end, None]
                for k_start, k_end in _key_blocks(q_end, qb[..., 0].numel()):
                    kb, vb = k[:, :, k_start:k_end], v[:, :, k_start:k_end]
                    weights = _block_scores(qb, kb, q_start, k_start, keys_visible).sub_(lse_b).exp_()
                    dv[:, :, k_start:k_end] += torch.einsum("bngqk,bngqd->bnkd", weights.to(v.dtype), gb).float()
                    d_scores = torch.einsum("bngqd,bnkd->bngqk", gb, vb).float().sub_(delta_b).mul_(weights).to(q.dtype)
                    d_scaled[:, :, :, q_start:q_end] += torch.einsum("bngqk,bnkd->bngqd", d_scores, kb).float()
                    dk[:, :, k_start:k_end] += torch.einsum("bngqk,bngqd->bnkd", d_scores, qb).float()
        return (d_scaled * scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
