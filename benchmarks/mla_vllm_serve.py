"""A trained MLA draft head (``drafter.model.attention: mla``) served by the real vLLM CPU build: served τ
against the export's offline τ@K, within :func:`~eagle3_pipeline.drafter.evaluate.acceptance.served_tau_bound`.

The target is :func:`~eagle3_pipeline.testing.mla_target.deepseek_mla_target`, a tiny random DeepSeek-V3
with Kimi's latent width (vLLM's CPU MLA backend refuses the Kimi stand-in's own). vLLM 0.32's CPU build
serves no MLA draft on a Llama target such as the embedded default (docs/eagle3.md, "The MLA draft head").
The drafter trains by the train phase on a store of the target's greedy continuations of a few prompts,
each row also its eval split (:func:`~eagle3_pipeline.testing.mla_target.train_mla_drafter`); the server
runs the export with K = ``--steps`` and τ comes from vLLM's ``/metrics`` counters as ``drafter_benchmark``
reads them, over the same prompts and continuation length, greedy.

    EAGLE3_VLLM_PYTHON=/work/main/.vllm-venv/bin/python nice -n 10 .venv/bin/python -m benchmarks.mla_vllm_serve
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from eagle3_pipeline.drafter.evaluate.acceptance import served_tau_bound
from eagle3_pipeline.drafter.serve.client import measure
from eagle3_pipeline.managed.launch import EagleDrafter, drafter_args
from eagle3_pipeline.testing.mla_target import SERVER_ARGS, train_mla_drafter
from eagle3_pipeline.testing.real_vllm import vllm_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--steps", type=int, default=3, help="K, the served draft depth (τ@K offline)")
    parser.add_argument("--plain", action="store_true", help="EAGLE-3 (default: EAGLE-3.1, fc_norm + norm_output)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="mla-serve-"))
    switches = {} if args.plain else {"fc_norm": True, "norm_output": True}
    trained = train_mla_drafter(
        work, new_tokens=args.new_tokens, epochs=args.epochs, steps=args.steps, switches=switches
    )
    final = trained.result["evals"][-1]
    offline = final[f"tau@{args.steps}"]
    extra = [*SERVER_ARGS, *drafter_args("vllm", EagleDrafter(str(trained.export), args.steps))]
    with vllm_server(trained.target, work / "vllm.log", extra_args=extra) as server:
        measured = measure(
            "vllm", server.root_url, prompts=trained.prompt_ids, max_tokens=args.new_tokens, concurrency=1,
            timeout_s=600.0, speculative=True,
        )  # fmt: skip
    acceptance = measured.acceptance
    if acceptance is None or not acceptance.per_position or not acceptance.verify_steps:
        raise SystemExit("vLLM reported no per-position acceptance")
    bound = served_tau_bound(acceptance.per_position, acceptance.verify_steps, measured.requests)
    config = json.loads((trained.export / "config.json").read_text())
    print(json.dumps({k: v for k, v in config.items() if k != "eagle3_pipeline"}, indent=1))
    print(f"MLA head ({'EAGLE-3' if args.plain else 'EAGLE-3.1'}), {trained.result['steps']} training steps, "
          f"{len(trained.prompt_ids)} prompts × {args.new_tokens} tokens, K = {args.steps}")  # fmt: skip
    per_depth = [round(final[f"accept_{j}"], 3) for j in range(args.steps)]
    print(f"offline τ@{args.steps} {offline:.4f}, per depth {per_depth}")
    print(f"served  τ {acceptance.tau:.4f}, P(accepted ≥ 1..K) {[round(r, 3) for r in acceptance.per_position]}, "
          f"{acceptance.verify_steps} verify steps (drafts)")  # fmt: skip
    gap = acceptance.tau - offline
    print(f"served − offline {gap:+.4f}, bound {bound:.4f}: {'within' if abs(gap) <= bound else 'OUTSIDE'}")


if __name__ == "__main__":
    main()
