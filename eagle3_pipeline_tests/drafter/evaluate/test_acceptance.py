"""The acceptance walker on hand-made sequences whose answers are worked out in the comments."""

from __future__ import annotations

import numpy as np
import pytest

from eagle3_pipeline.drafter.evaluate.acceptance import (
    ALL,
    AcceptanceInputError,
    AcceptanceStats,
    Agreement,
    compared_positions,
    evaluate,
    response_spans,
    sample_acceptance,
    served_tau_bound,
    stats_metadata,
    target_reference,
)

WRONG = 999
# positions 0..3 are the prompt, 4..11 the response (8 tokens; x_4 comes from prefill)
TOKENS = np.array([100, 101, 102, 103, 10, 11, 12, 13, 14, 15, 16, 17])
MASK = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1])


def oracle(tokens: np.ndarray, depth: int, shift: int = 2) -> np.ndarray:
    """pred[j, t] = x_{t+shift+j}: shift 2 is the right alignment (depth j after x_{t+1} guesses x_{t+2+j})."""
    padded = np.concatenate([tokens, np.full(depth + shift, WRONG)])
    return np.stack([padded[np.arange(len(tokens)) + shift + j] for j in range(depth)])


def drafts_with_leading(tokens: np.ndarray, depth: int, leading: dict[int, int]) -> np.ndarray:
    """Right for the first leading[t] depths at t, wrong at the next depth, right again after it
    (a later match must not count once an earlier depth missed)."""
    pred = oracle(tokens, depth)
    for t, a in leading.items():
        if a < depth:
            pred[a, t] = WRONG
    for t in range(len(tokens)):
        if t not in leading:
            pred[0, t] = WRONG
    return pred


def test_response_spans_are_the_runs_of_the_loss_mask() -> None:
    assert response_spans(MASK) == [(4, 12)]
    assert response_spans([0, 1, 1, 0, 0, 1, 0, 1, 1]) == [(1, 3), (5, 6), (7, 9)]
    assert response_spans([0, 0]) == []


def test_perfect_drafter_reaches_the_bound_except_at_the_end_of_the_response() -> None:
    # K=3. Steps start after prefill at t=3 (x_4 known): drafts x5..x7 accepted + bonus x8 -> 4 tokens,
    # t=7: drafts x9..x11 accepted, nothing after x11 -> 3 tokens; t=11 leaves nothing to draft.
    stats = AcceptanceStats((3,))
    stats.add(oracle(TOKENS, 3), TOKENS, MASK)
    assert (stats.walk_steps[3], stats.walk_tokens[3]) == (2, 7)
    assert stats.tau(3) == pytest.approx(3.5)
    # per position: eligible t = 3..9 with a = 3,3,3,3,3,2,1 -> 1 + 18/7
    assert stats.positions == 7
    assert stats.tau_per_position(3) == pytest.approx(1 + 18 / 7)
    assert stats.conditional_rates() == [1.0, 1.0, 1.0]


def test_off_by_one_drafters_accept_nothing() -> None:
    stats = AcceptanceStats((3,))
    for shift in (1, 3):  # guessing the token already known, or one too far ahead
        stats.add(oracle(TOKENS, 3, shift=shift), TOKENS, MASK)
    # 7 verify steps per response of 8 tokens, one token each
    assert stats.tau(3) == 1.0
    assert stats.tau_per_position(3) == 1.0
    assert stats.conditional_rates()[0] == 0.0


def test_mixed_drafter_known_walk_and_conditional_rates() -> None:
    leading = {3: 1, 4: 0, 5: 2, 6: 3, 7: 0, 8: 0, 9: 1}
    pred = drafts_with_leading(TOKENS, 3, leading)
    result = sample_acceptance(pred, TOKENS, MASK)
    assert [int(result.accepted[t]) for t in range(3, 10)] == [1, 0, 2, 3, 0, 0, 1]
    assert (result.accepted[:3] == -1).all() and (result.accepted[10:] == -1).all()

    stats = AcceptanceStats((1, 3))
    stats.add(pred, TOKENS, MASK)
    # K=3: t=3 a=1 (2 tokens) -> t=5 a=2 (3) -> t=8 a=0 (1) -> t=9 a=1 but only x11 is left (1) -> end
    assert (stats.walk_steps[3], stats.walk_tokens[3]) == (4, 7)
    assert stats.tau(3) == pytest.approx(7 / 4)
    # K=1: t=3 (2) -> t=5 (2) -> t=7 (1) -> t=8 (1) -> t=9 (1) -> end
    assert (stats.walk_steps[1], stats.walk_tokens[1]) == (5, 7)
    assert stats.tau(1) == pytest.approx(7 / 5)
    assert stats.tau_per_position(3) == pytest.approx(1 + 7 / 7)
    assert stats.tau_per_position(1) == pytest.approx(1 + 4 / 7)
    # depth 1: a>=1 at t=3,5,6,9 of 7; depth 2: of t=3,5,6 (t=9's x12 is past the end) a>=2 at 5,6;
    # depth 3: of t=5,6, a>=3 at 6
    assert stats.conditional_rates() == pytest.approx([4 / 7, 2 / 3, 1 / 2])


def test_two_responses_in_one_sample_are_walked_separately() -> None:
    tokens = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    mask = np.array([0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1])  # turns [2,5) and [8,11)
    stats = AcceptanceStats((3,))
    stats.add(oracle(tokens, 3), tokens, mask)
    # each turn: t=s-1 drafts x_{s+1}, x_{s+2} (a=2, the third depth leaves the turn) -> 2 tokens, 1 step
    assert stats.responses == 2
    assert (stats.walk_steps[3], stats.walk_tokens[3]) == (2, 4)
    # eligible t: 1, 2 and 7, 8 with a = 2, 1, 2, 1
    assert stats.tau_per_position(3) == pytest.approx(2.5)


def test_random_drafts_stay_within_bounds_and_the_walk_covers_every_response() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        length = int(rng.integers(2, 60))
        tokens = rng.integers(0, 4, size=length)
        mask = rng.integers(0, 2, size=length)
        mask[0] = 0  # a prompt token comes first
        pred = rng.integers(0, 4, size=(7, length))
        stats = AcceptanceStats((3, 5, 7))
        stats.add(pred, tokens, mask)
        drafted = sum(end - start - 1 for start, end in response_spans(mask))
        for k in (3, 5, 7):
            assert stats.walk_tokens[k] == drafted  # every response token after the prefill one, once
            assert 1.0 <= stats.tau(k) <= k + 1
            assert 1.0 <= stats.tau_per_position(k) <= k + 1
        assert stats.tau(3) <= stats.tau(5) <= stats.tau(7)


def test_evaluate_groups_by_dataset_and_flattens_metadata() -> None:
    perfect = oracle(TOKENS, 3)
    wrong = np.full_like(perfect, WRONG)
    results = evaluate((3,), [("B1", perfect, TOKENS, MASK), ("B2", wrong, TOKENS, MASK)])
    assert list(results) == ["B1", "B2", ALL]
    assert results["B1"].tau(3) == pytest.approx(3.5)
    assert results["B2"].tau(3) == 1.0
    assert results[ALL].tau(3) == pytest.approx((7 + 7) / (2 + 7))
    meta = stats_metadata("bigram_", results)
    assert meta["bigram_tau@3/B1"] == 3.5
    assert meta["bigram_accept_d1/B2"] == 0.0
    assert "bigram_tau_position@3/all" in meta


def test_a_response_at_position_zero_starts_drafting_after_its_first_token() -> None:
    tokens = np.arange(5)
    stats = AcceptanceStats((3,))
    stats.add(oracle(tokens, 3), tokens, np.ones(5))
    # t=0: x_0 and x_1 known, drafts x2..x4 accepted, nothing after -> 1 step of 3 tokens
    assert (stats.walk_steps[3], stats.walk_tokens[3]) == (1, 3)


def test_against_the_targets_argmax_a_draft_is_accepted_where_it_equals_the_argmax() -> None:
    argmax = np.concatenate([TOKENS[1:], [0]])  # greedy data: next_argmax[p] = x_{p+1}
    assert (target_reference(TOKENS, argmax) == TOKENS).all()
    argmax[5] = 1000  # the target would have put 1000 at x_6, the data hold 12
    reference = target_reference(TOKENS, argmax)
    assert reference[6] == 1000 and (np.delete(reference, 6) == np.delete(TOKENS, 6)).all()
    stored_drafts, target_drafts = oracle(TOKENS, 3), oracle(reference, 3)

    def tau(pred: np.ndarray, against: np.ndarray | None) -> float:
        stats = AcceptanceStats((3,))
        stats.add(pred, TOKENS, MASK, against)
        return stats.tau(3)

    # K=3 against a reference with x_6 changed: t=3 accepts x_5, rejects x_6 (2 tokens); t=5 accepts x_7..x_9
    # (4); t=9 drafts x_11, the last (1) -> 7 tokens / 3 steps. Drafting the reference itself: 7/2 as before.
    assert tau(stored_drafts, None) == tau(target_drafts, reference) == pytest.approx(3.5)
    assert tau(stored_drafts, reference) == tau(target_drafts, None) == pytest.approx(7 / 3)
    agreement = Agreement()
    agreement.add(TOKENS, MASK, reference)
    assert (agreement.positions, agreement.agreeing) == (7, 6)  # x_5..x_11: every response token but the prefill one
    agreement.add(TOKENS, MASK, target_reference(TOKENS, np.concatenate([TOKENS[1:], [0]])))
    assert agreement.rate == pytest.approx(13 / 14)
    assert Agreement().rate is None  # nothing compared: no figure, not 0 or 1


def test_the_agreement_positions_are_the_depth_zero_targets_of_the_walk() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        length = int(rng.integers(1, 40))
        mask = rng.integers(0, 2, size=length)
        result = sample_acceptance(np.zeros((1, length)), np.zeros(length), mask)
        assert compared_positions(mask).tolist() == (np.flatnonzero(result.eligible) + 2).tolist()


def test_shapes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(AcceptanceInputError, match=r"input_ids \[T\] and next_argmax \[T\]"):
        target_reference(TOKENS, TOKENS[:-1])
    with pytest.raises(AcceptanceInputError, match=r"the reference must be \[T\]"):
        AcceptanceStats((3,)).add(oracle(TOKENS, 3), TOKENS, MASK, TOKENS[:-1])
    with pytest.raises(AcceptanceInputError, match=r"pred \[K, T\]"):
        sample_acceptance(np.zeros((3, 5)), TOKENS, MASK)
    with pytest.raises(AcceptanceInputError, match="K >= 5"):
        AcceptanceStats((5,)).add(oracle(TOKENS, 3), TOKENS, MASK)


def test_the_served_tau_bound_by_hand() -> None:
    """P(a ≥ 1, 2, 3) = 0.5, 0.25, 0.1 over 100 steps of 2 requests: mean 0.85, E[a²] = 0.5 + 3·0.25 + 5·0.1
    = 1.75, sd √1.0275; 3·√2·√(1.0275/100) = 0.43005, plus 2·3·0.5/100 for the requests' last steps."""
    assert served_tau_bound([0.5, 0.25, 0.1], 100, 2) == pytest.approx(0.43005 + 0.03, abs=1e-5)
    with pytest.raises(AcceptanceInputError, match="0 verify steps"):
        served_tau_bound([0.5], 0, 1)
