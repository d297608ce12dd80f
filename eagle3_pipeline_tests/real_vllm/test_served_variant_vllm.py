"""An EAGLE-3.1 drafter (``fc_norm`` + ``norm_output``) served by the real vLLM (CPU build) accepts what it
accepted offline: the check that catches a drafter trained one way and served another (SpecForge trained
with the raw layer output while exporting ``norm_output: true`` until its PR #879).

The drafter is trained here, as the train phase trains it, on a store of the embedded model's own greedy
continuations of a few predictable prompts (:func:`greedy_store`; the same rows are its eval split), so it
accepts often at every depth and ``norm_output``, which only changes depths ≥ 1, shows in τ. The server
runs its export with the embedded model as the target; τ comes from vLLM's ``/metrics`` counters as
``drafter_benchmark`` reads them (:func:`measure`), on the same prompts and continuation length, and must
lie within :func:`served_tau_bound` of the offline τ@3 of the exported checkpoint. The embedded model stands
in for the 1T target.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.drafter.acceptance import served_tau_bound
from eagle3_pipeline.drafter.online import measure
from eagle3_pipeline.managed.launch import EagleDrafter, drafter_args
from eagle3_pipeline.testing.real_vllm import vllm_server
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.tiny_store import greedy_store
from eagle3_pipeline.testing.train_settings import train_settings

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
    from eagle3_pipeline.drafter.train import run

    prompts = greedy_store(tmp_path / "store", tmp_path / "vocab", local_model, PROMPTS, NEW_TOKENS, 256)
    settings = train_settings(
        ttt_steps=STEPS, lr=1e-2, epochs=EPOCHS, batch_tokens=1024, max_seq_len=128, checkpoint_every=EPOCHS,
        eval_samples=len(PROMPTS), seed=0, model={"fc_norm": True, "norm_output": True},
    )  # fmt: skip
    spec = {
        "store": str(tmp_path / "store"),
        "draft_vocab": str(tmp_path / "vocab"),
        "target_weights": str(local_model),
        "run_dir": str(tmp_path / "run"),
        "export_dir": str(tmp_path / "export"),
        "settings": settings,
    }
    result = run(spec, Recorder())
    offline = result["evals"][-1][f"tau@{STEPS}"]
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["fc_norm"] is True and exported["norm_output"] is True
    extra = drafter_args("vllm", EagleDrafter(str(tmp_path / "export"), STEPS))
    with vllm_server(local_model, tmp_path / "vllm.log", extra_args=extra) as server:
        measured = measure("vllm", server.root_url, prompts, NEW_TOKENS, 1, 600.0, True)
    acceptance = measured.acceptance
    assert acceptance is not None and acceptance.per_position and acceptance.verify_steps
    bound = served_tau_bound(acceptance.per_position, acceptance.verify_steps, measured.requests)
    print(
        f"EAGLE-3.1 τ@{STEPS}: served {acceptance.tau:.4f}, offline {offline:.4f} (bound {bound:.4f}); served per "
        f"position {[round(r, 3) for r in acceptance.per_position]}, offline accept_j "
        f"{[round(result['evals'][-1].get(f'accept_{j}', 0.0), 3) for j in range(STEPS)]}; "
        f"{acceptance.verify_steps} verify steps"
    )
    assert offline > 1.5, "the drafter must accept past depth 0 for norm_output to show"
    assert abs(acceptance.tau - offline) <= bound
