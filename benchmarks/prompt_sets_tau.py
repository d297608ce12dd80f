"""τ per prompt set and category against a real vLLM (CPU build): the embedded target with a pipeline-trained
drafter, on the held-out prompts per dataset, MT-Bench per category (both turns) and HumanEval, loop-flagged
requests apart (:mod:`eagle3_pipeline.drafter.serve.set_tau`).

The drafter and the training data are the embedded default's main job's (``eagle3-pipeline run``;
``--artifacts`` names another root). One speculative server serves every set; the table prints τ without and
with the loop-flagged requests, and the flagged requests themselves. ``--probe`` adds prompts of your own
(category ``probe``), e.g. one that makes the tiny target loop.

    nice -n 5 .venv/bin/python -m benchmarks.prompt_sets_tau --per-category 2 --held-out 4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from eagle3_pipeline.drafter.serve.benchmark import measure_prompt_sets
from eagle3_pipeline.drafter.serve.prompt_sets import BenchPrompt, load_sets
from eagle3_pipeline.drafter.serve.set_tau import SetSettings
from eagle3_pipeline.target.folder import load_tokenizer
from eagle3_pipeline.target.local_model import local_model_dir
from eagle3_pipeline.testing.real_vllm import vllm_server

DEFAULT_ARTIFACTS = Path.home() / ".local/share/eagle3_pipeline/local"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS)
    parser.add_argument("--sets", default="held_out,mt_bench,humaneval")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--held-out", type=int, default=4, help="held-out prompts per dataset")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--probe", action="append", default=[], help="a prompt of your own (repeatable)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    model, drafter = local_model_dir(), args.artifacts / "drafter" / "export"
    prompts = load_sets(args.sets.split(","), args.artifacts / "training_data", args.per_category, args.held_out)
    prompts += [BenchPrompt("probe", "probe", f"probe{i}", turns=(text,)) for i, text in enumerate(args.probe)]
    tokenizer = load_tokenizer(str(model))
    config = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": args.steps}
    log = Path("/tmp") / f"prompt_sets_tau-{int(time.time())}.log"
    settings = SetSettings(args.max_tokens, args.concurrency)
    with vllm_server(model, log, extra_args=["--speculative-config", json.dumps(config)]) as server:
        started = time.monotonic()
        figures = measure_prompt_sets(
            "vllm", server.root_url, prompts=prompts, tokenizer=tokenizer, settings=settings, timeout_s=600.0
        )
        wall = time.monotonic() - started
    print(f"target {model.name}, drafter {drafter} (K = {args.steps}), max_tokens {args.max_tokens}, {wall:.0f} s")
    header = f"{'set':10} {'category':12} {'requests':>8} {'tokens':>7} {'tau':>7} {'tau+loops':>9} {'loops':>5}"
    print(f"{header}  per position")
    for c in figures["categories"]:
        tau = f"{c['tau']:.3f}" if c["tau"] is not None else "-"
        with_loops = f"{c['tau_with_loops']:.3f}" if c["tau_with_loops"] is not None else "-"
        print(
            f"{c['set']:10} {c['category']:12} {c['requests']:8d} {c['completion_tokens']:7d} {tau:>7} "
            f"{with_loops:>9} {len(c['loop_flagged']):5d}  {c['acceptance_per_position']}"
        )
    for flag in figures["loop_flagged"]:
        print(f"loop-flagged: {flag}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
