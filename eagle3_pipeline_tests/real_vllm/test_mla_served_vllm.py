"""A trained MLA draft head (``drafter.model.attention: mla``, EAGLE-3.1) served by the real vLLM (CPU build)
accepts what it accepted offline: the check that the MLA export is served as it was trained (the latent
attention, DeepSeek's RoPE, the variants' norms).

The target is a tiny random DeepSeek-V3 with Kimi's latent width (:func:`deepseek_mla_target`; a stand-in
for Kimi-K2.5, whose own stand-in vLLM's CPU MLA backend refuses; vLLM's CPU build serves no MLA draft on
the embedded Llama target: docs/eagle3.md). The drafter is trained by the train phase on the target's
greedy continuations of a few prompts, those rows also its eval split (:func:`train_mla_drafter`); one
server runs the export and τ comes from its ``/metrics`` counters as ``drafter_benchmark`` reads them
(:func:`measure`), on the same prompts and continuation length: it must lie within
:func:`served_tau_bound` of the offline τ@3 of the exported checkpoint (1.69 against 1.66, bound 0.35), and
the drafter must accept past depth 0 offline. The same weights with each head's ``kv_b_proj`` split swapped
served at τ 1.08 (bound 0.07) and fail it; a flipped ``norm_output`` or a dropped YaRN barely move τ at this
size (docs/measurements.md, "The MLA head served against offline τ").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.drafter.evaluate.acceptance import served_tau_bound
from eagle3_pipeline.drafter.export.formats import MLA_ARCHITECTURE
from eagle3_pipeline.drafter.serve.client import measure
from eagle3_pipeline.managed.launch import EagleDrafter, drafter_args
from eagle3_pipeline.testing.mla_target import SERVER_ARGS, train_mla_drafter
from eagle3_pipeline.testing.real_vllm import vllm_server

pytest.importorskip("torch")

NEW_TOKENS = 48
STEPS = 3
EPOCHS = 60


def test_a_trained_mla_export_serves_at_its_offline_tau(real_vllm_python: Path, tmp_path: Path) -> None:
    switches = {"fc_norm": True, "norm_output": True}
    trained = train_mla_drafter(tmp_path, new_tokens=NEW_TOKENS, epochs=EPOCHS, steps=STEPS, switches=switches)
    final = trained.result["evals"][-1]
    offline = final[f"tau@{STEPS}"]
    exported = json.loads((trained.export / "config.json").read_text())
    assert exported["architectures"] == [MLA_ARCHITECTURE] and exported["kv_lora_rank"] == 512
    extra = [*SERVER_ARGS, *drafter_args("vllm", EagleDrafter(str(trained.export), STEPS))]
    with vllm_server(trained.target, tmp_path / "vllm.log", extra_args=extra) as server:
        measured = measure(
            "vllm", server.root_url, prompts=trained.prompt_ids, max_tokens=NEW_TOKENS, concurrency=1,
            timeout_s=600.0, speculative=True,
        )  # fmt: skip
    acceptance = measured.acceptance
    assert acceptance is not None and acceptance.per_position and acceptance.verify_steps
    bound = served_tau_bound(acceptance.per_position, acceptance.verify_steps, measured.requests)
    print(
        f"MLA EAGLE-3.1 τ@{STEPS}: served {acceptance.tau:.4f}, offline {offline:.4f} (bound {bound:.4f}); served "
        f"P(accepted ≥ 1, 2, 3) {[round(r, 3) for r in acceptance.per_position]}, offline accept_j "
        f"{[round(final[f'accept_{j}'], 3) for j in range(STEPS)]}; {acceptance.verify_steps} verify steps"
    )
    assert final["accept_1"] > 0.2, "the drafter must accept past depth 0 offline for the served chain to be checked"
    assert abs(acceptance.tau - offline) <= bound
