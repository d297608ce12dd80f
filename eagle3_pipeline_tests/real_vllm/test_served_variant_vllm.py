"""An EAGLE-3.1 drafter (``fc_norm`` + ``norm_output``) served by the real vLLM (CPU build) accepts what it
accepted offline: the check that catches a drafter trained one way and served another (SpecForge trained
with the raw layer output while exporting ``norm_output: true`` until its PR #879).

The drafter is trained here, as the train phase trains it, on a store of the embedded model's own greedy
continuations of a few predictable prompts (:func:`train_on_greedy_store`; the same rows are its eval split), so it
accepts often at every depth and ``norm_output``, which only changes depths ≥ 1, shows in τ. The server
runs its export with the embedded model as the target; τ comes from vLLM's ``/metrics`` counters as
``drafter_benchmark`` reads them (:func:`measure`), on the same prompts and continuation length, and must
lie within :func:`served_tau_bound` of the offline τ@3 of the exported checkpoint, and the share of verify
steps that accept at least two drafts must not fall below the offline share (Π of the first two ``accept_j``)
by more than 3·√2 of its binomial standard errors. Served with ``norm_output`` flipped in config.json, that
share fell from 0.078 to 0.000 over 284 steps against an offline 0.073 (τ 1.243 → 1.162 against 1.232, inside
the τ bound of 0.106 at this size: the per-depth check is the one that catches it). The embedded model stands
in for the 1T target.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eagle3_pipeline.drafter.evaluate.acceptance import served_tau_bound
from eagle3_pipeline.drafter.serve.client import measure
from eagle3_pipeline.managed.launch import EagleDrafter, drafter_args
from eagle3_pipeline.testing.real_vllm import vllm_server
from eagle3_pipeline.testing.train_settings import train_on_greedy_store

pytest.importorskip("torch")

PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "a b c d e f g h i j k",
    "Monday, Tuesday, Wednesday,",
    "January, February, March, April,",
    "10, 20, 30, 40, 50, 60,",
    "one two three four five six",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
]
NEW_TOKENS = 48
STEPS = 3
EPOCHS = 60


def test_an_eagle31_export_serves_at_its_offline_tau(real_vllm_python: Path, local_model: Path, tmp_path: Path) -> None:
    trained = train_on_greedy_store(
        tmp_path, local_model, PROMPTS, new_tokens=NEW_TOKENS, epochs=EPOCHS, steps=STEPS,
        model={"fc_norm": True, "norm_output": True},
    )  # fmt: skip
    prompts, result = trained.prompt_ids, trained.result
    offline = result["evals"][-1][f"tau@{STEPS}"]
    exported = json.loads((trained.export / "config.json").read_text())
    assert exported["fc_norm"] is True and exported["norm_output"] is True
    extra = drafter_args("vllm", EagleDrafter(str(trained.export), STEPS))
    with vllm_server(local_model, tmp_path / "vllm.log", extra_args=extra) as server:
        measured = measure(
            "vllm",
            server.root_url,
            prompts=prompts,
            max_tokens=NEW_TOKENS,
            concurrency=1,
            timeout_s=600.0,
            speculative=True,
        )
    acceptance = measured.acceptance
    assert acceptance is not None and acceptance.per_position and acceptance.verify_steps
    bound = served_tau_bound(acceptance.per_position, acceptance.verify_steps, measured.requests)
    final = result["evals"][-1]
    offline_two = final["accept_0"] * final["accept_1"]  # P(a verify step accepts ≥ 2 drafts), offline
    slack = 3 * math.sqrt(2) * math.sqrt(offline_two * (1 - offline_two) / acceptance.verify_steps)
    print(
        f"EAGLE-3.1 τ@{STEPS}: served {acceptance.tau:.4f}, offline {offline:.4f} (bound {bound:.4f}); served "
        f"P(accepted ≥ 1, 2, 3) {[round(r, 3) for r in acceptance.per_position]}, offline P(≥ 2) {offline_two:.3f} "
        f"(slack {slack:.3f}); {acceptance.verify_steps} verify steps"
    )
    assert offline_two > slack, "the drafter must accept past depth 0 often enough for norm_output to show"
    assert abs(acceptance.tau - offline) <= bound
    assert offline_two - acceptance.per_position[1] <= slack
