"""The bigram baseline: counts over generated tokens of the draft vocabulary, chain-wise drafts."""

from __future__ import annotations

import numpy as np
import pytest

from eagle3_pipeline.drafter.evaluate import bigram
from eagle3_pipeline.drafter.evaluate.acceptance import AcceptanceStats
from eagle3_pipeline.drafter.evaluate.bigram import BigramError, fit_bigram

V = 10
T2D = np.array([0, 1, 1, 1, 1, 0, 1, 1, 1, 1], dtype=bool)  # 0 and 5 are not in the draft vocabulary


def test_counts_only_generated_successors_in_the_draft_vocabulary() -> None:
    sequences = [
        # prompt 9 9 9 (unmasked pairs ignored), response 1 2 3 1 2 3 1 2 4
        (np.array([9, 9, 9, 1, 2, 3, 1, 2, 3, 1, 2, 4]), np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1])),
        # 7 -> 5 is generated but 5 is outside the draft vocabulary; 7 -> 6 and 7 -> 8 tie: the smaller wins
        (np.array([7, 5, 7, 6, 7, 8]), np.array([0, 1, 1, 1, 1, 1])),
    ]
    drafter = fit_bigram(sequences, T2D)
    assert drafter.next_token[1] == 2
    assert drafter.next_token[2] == 3  # 2->3 twice, 2->4 once
    assert drafter.next_token[3] == 1
    assert drafter.next_token[9] == 1  # the last prompt token -> first response token (masked) counts
    assert drafter.next_token[7] == 6
    assert drafter.next_token[5] == 7
    # 0 was never a predecessor: the most frequent draft token overall (2 and 1 tie at 3 → 1)
    assert drafter.next_token[0] == 1
    assert drafter.pairs == 9 + 4
    assert T2D[drafter.next_token].all()


def test_drafts_chain_from_the_token_after_each_position() -> None:
    drafter = fit_bigram([(np.array([0, 1, 2, 3, 1, 2, 3]), np.array([0, 1, 1, 1, 1, 1, 1]))], T2D)
    pred = drafter.predict(np.array([4, 1, 2]), steps=3)
    # t=0 starts after x_1 = 1: 2, 3, 1; t=1 after x_2 = 2: 3, 1, 2; t=2 has no x_3 (never eligible)
    assert pred[:, 0].tolist() == [2, 3, 1]
    assert pred[:, 1].tolist() == [3, 1, 2]


def test_a_periodic_response_is_drafted_perfectly() -> None:
    train = (np.array([8, 1, 2, 3, 4, 1, 2, 3, 4]), np.array([0, 1, 1, 1, 1, 1, 1, 1, 1]))
    drafter = fit_bigram([train], T2D)
    tokens = np.array([7, 8, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    mask = np.array([0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    stats = AcceptanceStats((3,))
    stats.add(drafter.predict(tokens, 3), tokens, mask)
    # 10 response tokens: t=1 (4 tokens) -> t=5 (4) -> t=9 (1, the last one) -> end
    assert (stats.walk_steps[3], stats.walk_tokens[3]) == (3, 9)
    assert stats.tau(3) == pytest.approx(3.0)


def test_merging_in_chunks_gives_the_same_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    sequences = [(rng.integers(0, V, 40), rng.integers(0, 2, 40)) for _ in range(30)]
    whole = fit_bigram(sequences, T2D)
    monkeypatch.setattr(bigram, "FLUSH_PAIRS", 7)
    chunked = fit_bigram(sequences, T2D)
    assert np.array_equal(whole.next_token, chunked.next_token)
    assert whole.pairs == chunked.pairs


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(BigramError, match="nothing to count"):
        fit_bigram([(np.array([1, 2]), np.array([0, 0]))], T2D)
    with pytest.raises(BigramError, match="outside the target vocabulary of 10"):
        fit_bigram([(np.array([1, 12]), np.array([0, 1]))], T2D)
    with pytest.raises(BigramError, match="differ"):
        fit_bigram([(np.array([1, 2]), np.array([1]))], T2D)
