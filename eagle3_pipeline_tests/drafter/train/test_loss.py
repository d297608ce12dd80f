"""The per-position losses (drafter.loss) against values computed by hand, and their gradients.

Row 0: p = (½, ½, 0), q = (¼, ¼, ½): α = ¼ + ¼ + 0 = ½, KL = 2·½·ln(½/¼) = ln 2, −log α = ln 2,
1 − α = ½, λ = e^(−3·½) = 0.22313, LK^λ = λ·ln 2 + (1 − λ)·½ = 0.54310.
Row 1: p = q = (0.2, 0.3, 0.5): α = 1, every loss 0 (LK^λ: λ = e^(−3), both of its terms 0).
Row 2: p = (1, 0, 0), q = (0.8, 0.1, 0.1): α = 0.8, KL = −ln 0.8 = 0.22314, λ = e^(−2.4) = 0.09072,
LK^λ = 0.09072·0.22314 + 0.90928·0.2 = 0.20210.
A batch-mean λ (SpecForge's) would weigh rows 0 and 2 alike; the paper's is per position.
Through the teacher: the target's p = (0.4, 0.1, 0.2, 0.3) over a draft vocabulary of tokens {0, 1} is
(0.8, 0.2) renormalised; against q = (½, ½), α = ½ + 0.2 = 0.7 (over the unrenormalised p: 0.5).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.drafter.train.data import teacher  # noqa: E402
from eagle3_pipeline.drafter.train.loss import position_losses, soft_label_cross_entropy, summed_loss  # noqa: E402

P = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
Q = torch.tensor([[0.25, 0.25, 0.5], [0.2, 0.3, 0.5], [0.8, 0.1, 0.1]])
LN2 = math.log(2)
EXPECTED = {
    "kl": [LN2, 0.0, -math.log(0.8)],
    "lk_alpha": [LN2, 0.0, -math.log(0.8)],
    "tv": [0.5, 0.0, 0.2],
    "lk_lambda": [
        math.exp(-1.5) * LN2 + (1 - math.exp(-1.5)) * 0.5,
        0.0,
        math.exp(-2.4) * -math.log(0.8) + (1 - math.exp(-2.4)) * 0.2,
    ],
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_loss_per_position_equals_the_hand_computed_value(kind: str) -> None:
    values = position_losses(Q.log(), P, kind, eta=3.0)
    torch.testing.assert_close(values, torch.tensor(EXPECTED[kind]), atol=1e-5, rtol=1e-5)
    assert EXPECTED["lk_lambda"][0] == pytest.approx(0.54310, abs=1e-5)
    assert EXPECTED["lk_lambda"][2] == pytest.approx(0.20210, abs=1e-5)


def test_a_batch_mean_lambda_would_not_give_the_hand_values() -> None:
    """SpecForge's λ = exp(−η·mean α) over the batch (mean α = 0.7667, λ = 0.1003) gives row 0
    0.5194 and row 2 0.2029: the per-position test above tells it from the paper's."""
    alpha = torch.tensor([0.5, 1.0, 0.8])
    kl, tv = torch.tensor(EXPECTED["kl"]), 1 - alpha
    batch_mean = torch.exp(-3.0 * alpha.mean())
    specforge = batch_mean * kl + (1 - batch_mean) * tv
    assert specforge[0].item() == pytest.approx(0.5194, abs=1e-4)
    assert not torch.allclose(specforge, torch.tensor(EXPECTED["lk_lambda"]), atol=1e-3)


def _teacher_row() -> Any:
    """The teacher's row for target logits log(0.4, 0.1, 0.2, 0.3) (lm_head the identity) over the draft
    vocabulary {0, 1}, as ttt_loss builds it."""
    hidden = torch.tensor([[[0.4, 0.1, 0.2, 0.3]]]).log()
    t2d = torch.tensor([True, True, False, False])
    return teacher(hidden, torch.eye(4), t2d).probs.flatten(0, 1)


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        ("tv", 0.3),
        ("lk_alpha", -math.log(0.7)),
        ("kl", 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)),
        ("lk_lambda", math.exp(-2.1) * (0.8 * math.log(1.6) + 0.2 * math.log(0.4)) + (1 - math.exp(-2.1)) * 0.3),
    ],
)
def test_alpha_is_over_the_renormalised_draft_distribution(kind: str, value: float) -> None:
    """α over p restricted to the draft vocabulary and renormalised (0.7), as the KL's teacher is: over
    the raw p it would be 0.5 (tv 0.5, lk_alpha ln 2)."""
    probs = _teacher_row()
    torch.testing.assert_close(probs, torch.tensor([[0.8, 0.2]]))
    logits = torch.tensor([[0.0, 0.0]])
    assert summed_loss(logits, probs, torch.tensor([0]), kind, 3.0).item() == pytest.approx(
        value + (0.0 if kind != "kl" else -(0.8 * math.log(0.8) + 0.2 * math.log(0.2))), rel=1e-5
    )
    assert position_losses(logits, probs, kind, 3.0).item() == pytest.approx(value, rel=1e-5)


def test_lk_lambda_does_not_differentiate_its_weight() -> None:
    """The gradient is λ·∇KL + (1 − λ)·∇(1 − α) with λ a number per position (stop-gradient)."""
    logits = Q.log().requires_grad_(True)
    position_losses(logits, P, "lk_lambda", eta=3.0).sum().backward()
    assert logits.grad is not None
    reference = Q.log().requires_grad_(True)
    weight = torch.tensor([math.exp(-1.5), math.exp(-3.0), math.exp(-2.4)])
    kl = position_losses(reference, P, "kl", 3.0)
    tv = position_losses(reference, P, "tv", 3.0)
    (weight * kl + (1 - weight) * tv).sum().backward()
    torch.testing.assert_close(logits.grad, reference.grad)


def test_lk_alpha_is_finite_where_the_draft_misses_the_target_entirely() -> None:
    logits = torch.tensor([[0.0, -1e9, -1e9]])
    value = position_losses(logits, torch.tensor([[0.0, 0.5, 0.5]]), "lk_alpha", 3.0)
    assert torch.isfinite(value).all() and value.item() == pytest.approx(-math.log(1e-6), rel=1e-4)


@pytest.mark.parametrize("kind", ["lk_alpha", "lk_lambda", "tv"])
def test_the_chunked_sum_equals_the_whole_sum_value_and_gradient(kind: str) -> None:
    """summed_loss gathers the teacher rows by index, chunk by chunk, recomputing each in the backward."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(9, 7, generator=g), -1)
    rows = torch.tensor([4, 0, 8, 8, 2, 5])
    whole = torch.randn(6, 7, generator=g).requires_grad_(True)
    chunked = whole.detach().clone().requires_grad_(True)
    position_losses(whole, probs[rows], kind, 3.0).sum().backward()
    total = summed_loss(chunked, probs, rows, kind, 3.0, chunk_rows=4)
    total.backward()
    assert total.item() == pytest.approx(position_losses(whole, probs[rows], kind, 3.0).sum().item(), rel=1e-6)
    torch.testing.assert_close(chunked.grad, whole.grad)


def test_kl_trains_with_the_cross_entropy_whose_gradient_it_shares() -> None:
    """kl's summed loss is the soft-label cross-entropy, KL plus the teacher's entropy (a constant)."""
    rows = torch.arange(3)
    entropy = -torch.xlogy(P, P).sum()
    ce = summed_loss(Q.log(), P, rows, "kl", 3.0)
    assert ce.item() == pytest.approx(soft_label_cross_entropy(Q.log(), P, rows).item())
    assert ce.item() == pytest.approx((position_losses(Q.log(), P, "kl", 3.0).sum() + entropy).item(), rel=1e-6)
