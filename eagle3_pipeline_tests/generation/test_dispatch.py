"""One id-ordered dispatcher: a real budget stop on a loopback server answers an id-ordered prefix of
the dataset, so long prompts are as represented among the answers as in the dataset, although they
are slower and have fewer slots; the per-class concurrency limits and the overshoot bound hold."""

from __future__ import annotations

import math
import random
import threading
import time
from pathlib import Path
from typing import Any

from eagle3_pipeline.generation import budget_state
from eagle3_pipeline.testing.fake_openai import FakeOpenAI, Reply, echo_completion
from eagle3_pipeline.testing.generation_runs import lines, make_prompts, run, settings


def test_a_budget_stop_keeps_the_dataset_share_of_long_prompts(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    prompts = make_prompts(300, prefix="short") + make_prompts(100, length_class="long", prefix="long")
    dataset_share = 100 / 400
    sizes = random.Random(5)
    lock = threading.Lock()
    active = {"short": 0, "long": 0}
    peak = {"short": 0, "long": 0}

    def script(body: dict[str, Any], n: int) -> Reply:
        cls = body["messages"][-1]["content"].split()[0]
        with lock:
            tokens = sizes.randint(1, 8)
            active[cls] += 1
            peak[cls] = max(peak[cls], active[cls])
        try:
            # Long prompts take 4x as long: with separate per-class queues, short ones ran ahead.
            time.sleep(0.04 if cls == "long" else 0.01)
            return Reply(payload=echo_completion(body, completion_tokens=tokens))
        finally:
            with lock:
                active[cls] -= 1

    fake_openai.script = script
    config = settings(concurrency={"short": 8, "long": 2})
    budget = 600
    summary = run(tmp_path, prompts, fake_openai, config, token_budget=budget)

    records = lines(tmp_path / "ck.jsonl")
    answered = {r["id"] for r in records}
    by_id = {p.id: p for p in prompts}
    long_answered = sum(1 for i in answered if by_id[i].length_class == "long")
    share = long_answered / len(answered)
    sigma = math.sqrt(dataset_share * (1 - dataset_share) / len(answered))
    tolerance = 3 * sigma
    state = budget_state(records, budget, config)
    ordered = sorted(by_id)
    print(
        f"\nbudget stop: {len(answered)} of {len(prompts)} answered ({long_answered} long); long share answered "
        f"{share:.3f} vs dataset {dataset_share:.3f} (|diff| {abs(share - dataset_share):.3f}, "
        f"tolerance 3σ = {tolerance:.3f}); "
        f"tokens {state.tokens} of budget {budget}, overshoot {state.overshoot} ≤ bound {state.overshoot_bound}; "
        f"peak in flight short {peak['short']}/8, long {peak['long']}/2; skipped_by_budget {summary.skipped_by_budget}"
    )
    assert answered == set(ordered[: len(answered)]), "the answers are exactly an id-ordered prefix of the dataset"
    assert abs(share - dataset_share) <= tolerance
    assert state.reached and state.overshoot <= state.overshoot_bound == 10 * 8
    assert peak["short"] <= 8 and peak["long"] <= 2, "the per-class concurrency limits still apply"
    assert summary.skipped_by_budget == len(prompts) - len(answered) > 0
    assert len(fake_openai.requests) == len(records), "nothing was dispatched and thrown away"


def test_without_a_budget_both_classes_use_their_slots(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    prompts = make_prompts(60, prefix="short") + make_prompts(20, length_class="long", prefix="long")
    fake_openai.delay_s = 0.02
    summary = run(tmp_path, prompts, fake_openai, settings(concurrency={"short": 6, "long": 3}))
    assert summary.generated == 80
    assert fake_openai.peak_in_flight > 3, "short and long requests are in flight together"
