"""The EAGLE-3 training objective and what measures it: the unrolled training-time-test loss
(:func:`ttt_loss`, SpecForge's ``OnlineEagle3Model``), the per-position losses it is built of (KL as the
soft-label cross-entropy, or the acceptance-targeted LK losses: :func:`position_losses`), and the
evaluation each checkpoint records (:func:`evaluate`: per-step loss and accuracy, τ, per-depth acceptance).

At TTT step j and index t the drafter predicts token t+2+j; the teacher is the target's distribution
at index t+1+j renormalised over the draft vocabulary. Details: drafter/DESIGN.md, "The loss".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eagle3_pipeline.drafter.evaluate.acceptance import ALL, AcceptanceStats, with_total
from eagle3_pipeline.drafter.evaluate.phase import add_drafter_batch
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
from eagle3_pipeline.drafter.spec import TrainSettings
from eagle3_pipeline.drafter.train.backend import ONE_PROCESS, Ranks
from eagle3_pipeline.drafter.train.data import Batch, BatchReader, Row, teacher

STEP_DECAY = 0.8
# Draft depths K whose τ each checkpoint records (those ≤ ttt_steps, and ttt_steps); the τ curve takes the
# smallest (drafter/DESIGN.md, "The τ curve and what more data buys").
EVAL_DEPTHS = (3, 5, 7)
# Logits per chunk of the soft-label loss: the float32 log-probabilities of one chunk (64 MiB).
LOSS_CHUNK_ELEMENTS = 1 << 24


class _SoftLabelCrossEntropy(torch.autograd.Function):
    """Σ_n −Σ_v probs[rows[n], v] · log_softmax(logits[n])_v, in chunks of rows: the float32
    log-probabilities exist one chunk at a time, forward and backward (d/dlogits = softmax · Σ_v p − p),
    and the soft labels are gathered from ``probs`` by row, never copied whole."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, chunk_rows: int
    ) -> torch.Tensor:
        with torch.autocast(logits.device.type, enabled=False):
            total = torch.zeros((), dtype=torch.float32, device=logits.device)
            for start in range(0, logits.shape[0], chunk_rows):
                labels = probs.index_select(0, rows[start : start + chunk_rows])
                total = total - (labels * torch.log_softmax(logits[start : start + chunk_rows].float(), dim=-1)).sum()
        ctx.save_for_backward(logits, probs, rows)
        ctx.chunk_rows = chunk_rows
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, probs, rows = ctx.saved_tensors
        chunk_rows = ctx.chunk_rows
        grad_logits = torch.empty_like(logits)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], chunk_rows):
                labels = probs.index_select(0, rows[start : start + chunk_rows])
                softmax = torch.softmax(logits[start : start + chunk_rows].float(), dim=-1)
                grad_logits[start : start + chunk_rows] = (grad * (softmax * labels.sum(-1, keepdim=True) - labels)).to(
                    logits.dtype
                )
        return grad_logits, None, None, None


def soft_label_cross_entropy(
    logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """The summed soft-label cross-entropy of ``logits`` [N, Vd] against the rows ``rows`` [N] of
    ``probs`` [M, Vd] (the teacher's distributions), computed in chunks of ``chunk_rows`` rows
    (default: :data:`LOSS_CHUNK_ELEMENTS` logits a chunk)."""
    return _SoftLabelCrossEntropy.apply(
        logits, probs, rows, chunk_rows or max(1, LOSS_CHUNK_ELEMENTS // logits.shape[-1])
    )


LOSSES = ("kl", "lk_alpha", "lk_lambda", "tv")
# log α is floored here (lk_alpha): a position whose draft puts no mass on the target's support would
# otherwise give an infinite loss.
ALPHA_FLOOR = 1e-6


def position_losses(logits: torch.Tensor, labels: torch.Tensor, kind: str, eta: float) -> torch.Tensor:
    """Per-position losses [N] of the draft ``logits`` [N, Vd] against the teacher ``labels`` [N, Vd]
    (the target's distribution p renormalised over the draft vocabulary), q = softmax(logits),
    α = Σ_v min(p_v, q_v) the probability a sampled draft is accepted (arXiv 2602.23881):
    ``kl`` KL(p‖q); ``lk_alpha`` −log α; ``tv`` 1 − α; ``lk_lambda`` λ·KL + (1 − λ)(1 − α) with
    λ = exp(−η·α) per position and not differentiated (the paper's stop-gradient)."""
    log_q = torch.log_softmax(logits.float(), dim=-1)
    alpha = torch.minimum(labels, log_q.exp()).sum(-1)
    if kind == "tv":
        return 1.0 - alpha
    if kind == "lk_alpha":
        return -torch.log(alpha.clamp(min=ALPHA_FLOOR))
    kl = (torch.xlogy(labels, labels) - labels * log_q).sum(-1)
    if kind == "kl":
        return kl
    if kind == "lk_lambda":
        weight = torch.exp(-eta * alpha.detach())
        return weight * kl + (1.0 - weight) * (1.0 - alpha)
    raise ValueError(f"drafter.loss {kind!r}: expected one of {list(LOSSES)}")


def summed_loss(
    logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, kind: str, eta: float, chunk_rows: int | None = None
) -> torch.Tensor:
    """Σ over the rows of :func:`position_losses` of ``logits`` [N, Vd] against ``probs[rows]``, chunk by
    chunk. ``kl`` takes the soft-label cross-entropy (its gradient; the value differs from KL by the
    teacher's entropy, a constant); the others recompute each chunk's float32 softmax in the backward
    pass, so no more than one chunk of it exists at a time."""
    if kind == "kl":
        return soft_label_cross_entropy(logits, probs, rows, chunk_rows)
    chunk_rows = chunk_rows or max(1, LOSS_CHUNK_ELEMENTS // logits.shape[-1])

    def chunk_loss(chunk: torch.Tensor, chunk_ids: torch.Tensor) -> torch.Tensor:
        return position_losses(chunk, probs.index_select(0, chunk_ids), kind, eta).sum()

    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    with torch.autocast(logits.device.type, enabled=False):
        for start in range(0, logits.shape[0], chunk_rows):
            end = start + chunk_rows
            part = checkpoint(chunk_loss, logits[start:end], rows[start:end], use_reentrant=False)
            total = total + cast(torch.Tensor, part)
    return total


@dataclass
class StepMetrics:
    """One batch on one rank, all on the device: ``loss`` the weighted total and ``step_losses``
    [steps] (this rank's share of the batch's loss when several ranks), ``hits`` [steps] the
    loss-masked positions whose mapped draft argmax is the target's argmax, ``trained`` [steps]
    the loss-masked positions."""

    loss: torch.Tensor
    step_losses: torch.Tensor
    hits: torch.Tensor
    trained: torch.Tensor


def ttt_loss(
    model: Eagle3Drafter,
    batch: Batch,
    *,
    lm_head: torch.Tensor,
    steps: int,
    ranks: Ranks = ONE_PROCESS,
    forward: Callable[..., list[torch.Tensor]] | None = None,
    activation_checkpointing: bool = False,
    loss_kind: str = "kl",
    eta: float = 3.0,
) -> StepMetrics:
    """Unrolled TTT forward (through ``forward``, the DDP wrapper, when given; its decoder layer
    recomputed in the backward with ``activation_checkpointing``), the ``loss_kind`` loss
    (:func:`position_losses`) against the target over the draft vocabulary, in chunks of counted
    positions (:func:`summed_loss`: no float32 log-probabilities or label copies beside the logits).
    Each step's loss is divided by the counted positions of the whole batch (summed over ``ranks``),
    so the ranks' losses add up to it: a mean over positions, as the LK losses are defined."""
    # The prediction at index p is trained when token p + 1 is (loss mask); only those need the teacher.
    target = teacher(batch.hidden, lm_head, model.t2d, F.pad(batch.loss_mask[:, 1:], (0, 1)))
    argmaxes = [F.pad(target.argmax[:, j + 1 :], (0, j + 1)) for j in range(steps)]
    trained = [F.pad(batch.loss_mask[:, j + 2 :], (0, j + 2)).float() for j in range(steps)]
    counted = [t * model.t2d[a].float() for t, a in zip(trained, argmaxes, strict=True)]
    counts = ranks.all_reduce(torch.stack([c.sum() for c in counted])).clamp(min=1.0)
    # Only counted indices reach the loss, and only they can hit (elsewhere the target's argmax is not
    # in the draft vocabulary, or the index is not trained): the draft head runs on them alone.
    keep = [c.bool() for c in counted]
    logits = (forward or model)(batch.aux, batch.input_ids, steps, batch.attention_mask, keep, activation_checkpointing)
    probs = target.probs.flatten(0, 1)
    total = torch.zeros((), device=batch.aux.device)
    step_losses: list[torch.Tensor] = []
    hits: list[torch.Tensor] = []
    for j, step_logits in enumerate(logits):
        # Step j's teacher at index t is the target's distribution at t + 1 + j (< T where counted).
        rows = keep[j].flatten().nonzero().squeeze(1) + (j + 1)
        loss = summed_loss(step_logits, probs, rows, loss_kind, eta) / counts[j]
        total = total + (STEP_DECAY**j) * loss
        step_losses.append(loss.detach())
        with torch.no_grad():
            hits.append((model.draft_target_ids(step_logits) == argmaxes[j][keep[j]]).float().sum())
    return StepMetrics(total, torch.stack(step_losses), torch.stack(hits), torch.stack([t.sum() for t in trained]))


def eval_depths(ttt_steps: int, select_steps: int | None = None) -> list[int]:
    """The depths each checkpoint's τ is measured at: :data:`EVAL_DEPTHS` up to ``ttt_steps``, and
    ``ttt_steps`` and ``select_steps`` (the depth the best checkpoint is chosen by)."""
    extra = {ttt_steps} if select_steps is None else {ttt_steps, select_steps}
    return sorted({k for k in EVAL_DEPTHS if k <= ttt_steps} | extra)


@torch.no_grad()
def evaluate(
    model: Eagle3Drafter,
    reader: BatchReader,
    *,
    eval_batches: Mapping[str, list[list[Row]]],
    lm_head: torch.Tensor,
    settings: TrainSettings,
    device: torch.device,
    autocast: torch.dtype | None,
) -> tuple[dict[str, float], dict[str, AcceptanceStats]]:
    """Per-step loss (the training loss) and accuracy on the eval split, weighted by tokens, the
    acceptance length τ a greedy chain-drafting server would see (``tau@K``: accuracy can look fine
    while τ collapses) and the acceptance at each depth given the drafts before it (``accept_j``).
    Also the acceptance per eval dataset (``eval_batches``' keys) and ``all``, for the τ curve."""
    model.eval()
    depths = eval_depths(settings.ttt_steps, settings.select_steps)
    per_dataset = {dataset: AcceptanceStats(ks=tuple(depths)) for dataset in eval_batches}
    losses = torch.zeros(settings.ttt_steps, device=device)
    hits = torch.zeros(settings.ttt_steps, device=device)
    trained = torch.zeros(settings.ttt_steps, device=device)
    weight = 0
    for dataset, dataset_batches in eval_batches.items():
        for _, batch in reader.batches(dataset_batches):
            tokens = int(batch.loss_mask.sum())
            batch = batch.to(device)
            with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
                metrics = ttt_loss(
                    model,
                    batch,
                    lm_head=lm_head,
                    steps=settings.ttt_steps,
                    loss_kind=settings.loss,
                    eta=settings.lk_eta,
                )
                add_drafter_batch(
                    per_dataset[dataset], model, batch.aux, batch.input_ids, batch.loss_mask, batch.attention_mask
                )
            weight += tokens
            losses += metrics.step_losses * tokens
            hits += metrics.hits
            trained += metrics.trained
    model.train()
    if not weight:
        return {}, {}
    acceptance = with_total(per_dataset, depths)
    loss_values = (losses / weight).tolist()
    acc_values = (hits / trained.clamp(min=1.0)).tolist()
    return {
        **{f"eval_loss_{j}": loss_values[j] for j in range(settings.ttt_steps)},
        **{f"eval_acc_{j}": acc_values[j] for j in range(settings.ttt_steps)},
        **{f"tau@{k}": acceptance[ALL].tau(k) for k in depths},
        **{f"accept_{j}": rate for j, rate in enumerate(acceptance[ALL].conditional_rates()) if rate is not None},
    }, acceptance
