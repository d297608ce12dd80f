"""Train/serve agreement of each drafter variant: the export of a ``benchmarks.drafter_variants`` run served
by the real vLLM (CPU build) with the embedded default as the target, τ measured as ``drafter_benchmark``
measures it (:func:`eagle3_pipeline.drafter.serve.benchmark.measure`: vLLM's ``/metrics`` counters around the eval
prompts), against the run's offline τ@K of the exported checkpoint on the same eval rows, within
:func:`served_tau_bound` (the bound of ``real_vllm/test_main_job.py``'s τ check).

``--flip norm_output`` serves a copy of each export with that switch of its config.json inverted (the weights
unchanged): what an export trained one way and served another (SpecForge before PR #879) gives.

    nice -n 5 .venv/bin/python -m benchmarks.served_variants --work /tmp/eagle3_drafter_variants
    nice -n 5 .venv/bin/python -m benchmarks.served_variants --runs fc_norm+norm_output-kl-s0 --flip norm_output
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import load_config, local_profile_path
from eagle3_pipeline.drafter.evaluate.acceptance import served_tau_bound
from eagle3_pipeline.drafter.serve.benchmark import eval_prompts
from eagle3_pipeline.drafter.serve.client import measure
from eagle3_pipeline.managed.launch import EagleDrafter, drafter_args
from eagle3_pipeline.target.local_model import prepare_local_model
from eagle3_pipeline.testing.real_vllm import vllm_server

REQUEST_TIMEOUT_S = 600.0


def flipped(export: Path, key: str, folder: Path) -> Path:
    """A copy of ``export`` whose config.json has ``key`` inverted (absent counts as false)."""
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(export, folder)
    config = json.loads((folder / "config.json").read_text())
    config[key] = not config.get(key, False)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def serve_one(model: Path, export: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """τ and per-position acceptance of ``export`` served by vLLM on ``prompts`` (greedy, ``--max-tokens``)."""
    extra = drafter_args("vllm", EagleDrafter(str(export), args.steps))
    with vllm_server(model, args.out / f"{export.parent.name}-{export.name}.log", extra_args=extra) as server:
        measured = measure(
            "vllm",
            server.root_url,
            prompts=prompts,
            max_tokens=args.max_tokens,
            concurrency=args.concurrency,
            timeout_s=REQUEST_TIMEOUT_S,
            speculative=True,
        )
    acceptance = measured.acceptance
    if acceptance is None or not acceptance.per_position or not acceptance.verify_steps:
        sys.exit(f"{export}: vLLM reported no per-position acceptance")
    return {
        "tau_served": acceptance.tau,
        "per_position": acceptance.per_position,
        "verify_steps": acceptance.verify_steps,
        "bound": served_tau_bound(acceptance.per_position, acceptance.verify_steps, measured.requests),
        "tokens_per_s": measured.tokens_per_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/eagle3_drafter_variants"))
    parser.add_argument("--runs", help="run names under --work (default: every finished *-s0 run with loss kl)")
    parser.add_argument("--flip", help="serve each export with this config.json switch inverted")
    parser.add_argument("--steps", type=int, default=3, help="K, the served draft depth (τ@K offline)")
    parser.add_argument("--max-tokens", type=int, default=128, help="the stored responses' budget")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("/tmp/eagle3_served_variants"))
    args = parser.parse_args()
    names = args.runs.split(",") if args.runs else sorted(p.stem for p in args.work.glob("*-kl-s0.json"))
    config = load_config(local_profile_path())
    prompts = eval_prompts(config.artifacts_root / "training_data", 1000)
    model, _ = prepare_local_model()
    args.out.mkdir(parents=True, exist_ok=True)
    key = f"tau@{args.steps}"
    print(f"vLLM (CPU build), {len(prompts)} eval prompts, {args.max_tokens} tokens greedy, K = {args.steps}"
          + (f", {args.flip} flipped in the served config.json" if args.flip else ""))  # fmt: skip
    print("| run | offline τ@K | served τ | served − offline | bound | within | served per position |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        offline = json.loads((args.work / f"{name}.json").read_text())["best"][key]
        export = args.work / name / "export"
        if args.flip:
            export = flipped(export, args.flip, args.out / name / f"flipped-{args.flip}")
        served = serve_one(model, export, prompts, args)
        gap = served["tau_served"] - offline
        (args.out / f"{name}{'-flipped' if args.flip else ''}.json").write_text(json.dumps({**served, key: offline}))
        print(f"| {name} | {offline:.4f} | {served['tau_served']:.4f} | {gap:+.4f} | {served['bound']:.4f} | "
              f"{'yes' if abs(gap) <= served['bound'] else 'NO'} | "
              f"{', '.join(f'{r:.3f}' for r in served['per_position'])} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
