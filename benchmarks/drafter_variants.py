"""Drafter variants and losses on the embedded default, the same data and budget: offline τ@K and the
per-depth acceptance of each (variant, loss, seed), at the last checkpoint and at the best one.

Every run takes the local profile's drafter settings (epochs, lr, batch, sequence length) on the store
the embedded default's main job wrote (``eagle3-pipeline run``; ``--artifacts`` names another) and
differs only in the switches named: ``--variants`` are ``+``-joined ``drafter.model`` switches
(``eagle3`` for none, e.g. ``fc_norm+norm_output`` for EAGLE-3.1, ``norm_before_fc+norm_output`` for
speculators' #610 variant), ``--losses`` are ``drafter.loss`` values, ``--seeds`` the training seeds.
The first variant with the first loss is the baseline: every variant trains with the first loss, and the
other losses train on the first variant only (``--cross``: every variant with every loss).
Each run evaluates every ``--checkpoint-every`` steps on the store's eval split (τ at the served K,
``--select-steps``) and exports its best checkpoint (``select: best``); the last is the run's final
evaluation. The best is chosen on the same eval split it is reported on, so its τ is biased upwards:
the table says so. Runs go under ``--work`` and a rerun with the same folder trains nothing again;
``--table`` prints the table of the runs finished there so far, each row's τ also as a ratio to the
baseline's on the same seeds (mean ± sd of the per-seed ratios).

    nice -n 10 .venv/bin/python -m benchmarks.drafter_variants --epochs 3 --checkpoint-every 12 --seeds 0,1 \\
        --variants eagle3,fc_norm+norm_output,fc_norm,norm_output,norm_before_fc+norm_output \\
        --losses kl,lk_alpha,lk_lambda,tv
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.seeded_runs import mean_sd, trained_run
from eagle3_pipeline.config import load_config, local_profile_path
from eagle3_pipeline.drafter.model.draft_config import VARIANT_KEYS
from eagle3_pipeline.drafter.spec import train_spec

PLAIN = "eagle3"


def switches(variant: str) -> dict[str, bool]:
    """``drafter.model`` switches of a ``+``-joined variant name (``eagle3``: none)."""
    names = [] if variant == PLAIN else variant.split("+")
    unknown = sorted(set(names) - set(VARIANT_KEYS))
    if unknown:
        sys.exit(f"--variants {variant}: unknown {unknown}; expected {PLAIN} or a +-joined subset of {VARIANT_KEYS}")
    return dict.fromkeys(names, True)


def one_run(base: dict[str, Any], work: Path, variant: str, loss: str, seed: int, args: argparse.Namespace) -> dict:
    name = f"{variant}-{loss}-s{seed}"
    settings = {
        **base["settings"],
        "model": {**base["settings"]["model"], **switches(variant)},
        "loss": loss,
        "seed": seed,
        "select": "best",
        "select_steps": args.select_steps,
        "checkpoint_every": args.checkpoint_every,
        **({"epochs": args.epochs} if args.epochs else {}),
    }
    spec = {
        **base,
        "run_dir": str(work / name / "run"),
        "export_dir": str(work / name / "export"),
        "settings": settings,
    }
    return trained_run(work, name, spec, args.select_steps, variant=variant, loss=loss, seed=seed)


def runs(variants: list[str], losses: list[str], cross: bool) -> list[tuple[str, str]]:
    """(variant, loss) pairs: every variant with the first loss, then the other losses on the first variant
    (``cross``: the full product)."""
    if cross:
        return [(v, loss) for v in variants for loss in losses]
    return [(v, losses[0]) for v in variants] + [(variants[0], loss) for loss in losses[1:]]


def _ratio(group: list[dict[str, Any]], baseline: dict[int, dict[str, Any]], key: str, which: str) -> str:
    """The group's τ over the baseline's on the same seed (the baseline is ``last``), mean ± sd over seeds."""
    ratios = [r[which][key] / baseline[r["seed"]]["last"][key] for r in group if r["seed"] in baseline]
    return mean_sd(ratios) if ratios else "—"


def table(rows: list[dict[str, Any]], k: int) -> str:
    """Markdown: one line per (variant, loss) in run order, mean ± sd over the seeds (sd of the seeds, not of
    the mean), and the ratio of τ to the first row's (the baseline) on the same seeds."""
    key = f"tau@{k}"
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["variant"], row["loss"]), []).append(row)
    baseline = {r["seed"]: r for r in next(iter(groups.values()), [])}
    accepts = [f"accept_{j}" for j in range(k)]
    lines = [
        f"| variant | loss | seeds | {key} last | ratio | {key} best (step) | ratio | "
        + " | ".join(f"{a} last" for a in accepts)
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(accepts),
    ]
    for (variant, loss), group in groups.items():
        best_steps = ",".join(str(int(r["best"]["step"])) for r in group)
        lines.append(
            f"| {variant} | {loss} | {len(group)} | {mean_sd([r['last'][key] for r in group])} | "
            f"{_ratio(group, baseline, key, 'last')} | {mean_sd([r['best'][key] for r in group])} ({best_steps}) | "
            f"{_ratio(group, baseline, key, 'best')} | "
            + " | ".join(mean_sd([r["last"].get(a, 0.0) for r in group]) for a in accepts)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", type=Path, help="default: the embedded default's artifacts root")
    parser.add_argument("--work", type=Path, default=Path("/tmp/eagle3_drafter_variants"))
    parser.add_argument(
        "--variants", default=f"{PLAIN},fc_norm+norm_output,fc_norm,norm_output,norm_before_fc+norm_output"
    )
    parser.add_argument("--losses", default="kl,lk_alpha,lk_lambda,tv")
    parser.add_argument("--cross", action="store_true", help="every variant with every loss")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--epochs", type=int, help="default: the local profile's")
    parser.add_argument("--checkpoint-every", type=int, default=15)
    parser.add_argument("--select-steps", type=int, default=3)
    parser.add_argument("--table", action="store_true", help="only print the table of the runs finished in --work")
    args = parser.parse_args()
    planned = runs(args.variants.split(","), args.losses.split(","), args.cross)
    if args.table:
        done = {p.stem: json.loads(p.read_text()) for p in args.work.glob("*.json")}
        order = [f"{v}-{loss}-s{seed}" for seed in args.seeds.split(",") for v, loss in planned]
        print(table([done[n] for n in order if n in done], args.select_steps))
        return
    config = load_config(local_profile_path())
    base = train_spec(config, (args.artifacts or config.artifacts_root).resolve())
    if not Path(base["store"], "index.parquet").is_file():
        sys.exit(f"no hidden-state store under {base['store']}: run `eagle3-pipeline run` first (or pass --artifacts)")
    settings = base["settings"]
    print(f"local profile drafter: {args.epochs or settings['epochs']} epochs, lr {settings['lr']}, batch_tokens "
          f"{settings['batch_tokens']}, ttt_steps {settings['ttt_steps']}; a checkpoint every {args.checkpoint_every} "
          f"steps; τ@{args.select_steps} on the eval split")  # fmt: skip
    rows = [
        one_run(base, args.work, variant, loss, int(seed), args)
        for seed in args.seeds.split(",")
        for variant, loss in planned
    ]
    for row in rows:
        print(f"  {row['variant']} {row['loss']} seed {row['seed']}: {row['steps']} steps, {row['wall_s']} s")
    print(table(rows, args.select_steps))


if __name__ == "__main__":
    main()
