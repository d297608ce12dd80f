"""The train/eval split is independent of the prompt sample: `prompts` keeps the records with the
smallest `sha256(f"{seed}:{id}")`, so a split decided by that same hash sent every sampled record of a
small sample to eval (a 6-of-70 sample at eval_fraction 0.3: 6 eval rows, 0 train)."""

from __future__ import annotations

import hashlib

from eagle3_pipeline.generation.prompts import sample_key
from eagle3_pipeline.training_data import split_of


def test_a_small_sample_splits_at_the_eval_fraction() -> None:
    ids = [hashlib.sha256(f"record {i}".encode()).hexdigest()[:20] for i in range(2000)]
    for seed in (0, 7, 1234):
        sampled = sorted(ids, key=lambda i: sample_key(seed, i))[:200]
        share = sum(split_of(i, seed, 0.3) == "eval" for i in sampled) / len(sampled)
        assert 0.2 < share < 0.4, (seed, share)
