"""Warm start against training from scratch on the embedded default: a drafter trained on a seeded half
of the training rows (per dataset, as the τ-scaling benchmark takes it) is exported; then, per seed, a
drafter trained on the full data starting from that export (``drafter.init_from``; with each
``--l2sp`` weight) and one from a seeded init, with the same settings and budget (the local profile's
drafter: lr, batch, sequence length; ``--epochs`` for the full-data runs, ``--start-epochs`` for the
half run). Printed per arm: τ@K of the start (measured on the eval split before the first step), τ@K
after (the last checkpoint, and the best evaluated one) and the acceptance at each depth (last), mean ±
sd over the seeds. The seeds vary the full-data runs; the start is one half run (``--start-seed``).

The eval split is the same for every run (the half store keeps all eval rows). The start is the half
run's export as a user would have it (bfloat16). Runs go under ``--work``; a rerun with the same folder
trains nothing again (finished runs are read back from their ``.json``).

    nice -n 5 .venv/bin/python -m benchmarks.drafter_warm_start --seeds 0,1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.seeded_runs import mean_sd, trained_run
from benchmarks.tau_scaling import half_store
from eagle3_pipeline.config import load_config, local_profile_path
from eagle3_pipeline.drafter.spec import train_spec


def one_run(base: dict[str, Any], work: Path, name: str, store: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Train (or read back) one run on ``store``; its last and best eval and the start's eval when it had one."""
    spec = {**base, "store": str(store), "run_dir": str(work / name / "run"),
            "export_dir": str(work / name / "export"), "settings": settings}  # fmt: skip
    return trained_run(work, name, spec, settings["select_steps"], name=name)


def table(runs: dict[str, list[dict[str, Any]]], k: int) -> str:
    """Markdown, one line per arm: mean ± sd over the seeds (the sd of the seeds, not of the mean)."""
    key, accepts = f"tau@{k}", [f"accept_{j}" for j in range(k)]
    lines = [
        f"| arm | seeds | steps | {key} start | {key} last | {key} best | " + " | ".join(accepts) + " (last) |",
        "|---|---|---|---|---|---|" + "---|" * k,
    ]
    for arm, rows in runs.items():
        starts = [r["start"][key] for r in rows if r.get("start")]
        lines.append(
            f"| {arm} | {len(rows)} | {rows[0]['steps']} | {mean_sd(starts)} | "
            f"{mean_sd([r['last'][key] for r in rows])} | {mean_sd([r['best'][key] for r in rows])} | "
            + " | ".join(mean_sd([r["last"].get(a, 0.0) for r in rows]) for a in accepts)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", type=Path, help="default: the embedded default's artifacts root")
    parser.add_argument("--work", type=Path, default=Path("/tmp/eagle3_drafter_warm_start"))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--l2sp", default="0", help="comma-separated drafter.init_l2sp weights of the warm arms")
    parser.add_argument("--epochs", type=int, help="epochs of the full-data runs; default: the local profile's")
    parser.add_argument("--start-epochs", type=int, help="epochs of the half-data run; default: the local profile's")
    parser.add_argument("--start-seed", type=int, default=0)
    parser.add_argument(
        "--arms",
        default="warm,scratch",
        help="which full-data arms to train (several processes "
        "may share a --work folder, e.g. the scratch arm while the start trains)",
    )
    parser.add_argument("--checkpoint-every", type=int, default=15)
    parser.add_argument("--select-steps", type=int, default=3)
    args = parser.parse_args()
    config = load_config(local_profile_path())
    base = train_spec(config, (args.artifacts or config.artifacts_root).resolve())
    full = Path(base["store"])
    if not (full / "index.parquet").is_file():
        sys.exit(f"no hidden-state store under {full}: run `eagle3-pipeline run` first (or pass --artifacts)")
    common = {**base["settings"], "checkpoint_every": args.checkpoint_every, "select_steps": args.select_steps,
              "select": "last"}  # fmt: skip
    epochs = {"start": args.start_epochs or common["epochs"], "full": args.epochs or common["epochs"]}
    print(f"local profile drafter: lr {common['lr']}, batch_tokens {common['batch_tokens']}, ttt_steps "
          f"{common['ttt_steps']}; epochs: {epochs['start']} on half the data (the start), {epochs['full']} on the "
          f"full data; τ@{args.select_steps} on the eval split")  # fmt: skip
    arms = set(args.arms.split(","))
    name = f"half-s{args.start_seed}"
    runs: dict[str, list[dict[str, Any]]] = {}
    if "warm" in arms:
        half = half_store(full, args.work / f"half_store-s{args.start_seed}", args.start_seed)
        start = {**common, "seed": args.start_seed, "epochs": epochs["start"]}
        runs["half data (the start)"] = [one_run(base, args.work, name, half, start)]
    for seed in (int(s) for s in args.seeds.split(",")):
        settings = {**common, "seed": seed, "epochs": epochs["full"]}
        for weight in (float(w) for w in args.l2sp.split(",") if "warm" in arms):
            warm = {**settings, "init_from": str(args.work / name / "export"), "init_l2sp": weight}
            arm = "warm start, full data" + (f", L2-SP {weight:g}" if weight else "")
            runs.setdefault(arm, []).append(one_run(base, args.work, f"warm-l2sp{weight:g}-s{seed}", full, warm))
        if "scratch" in arms:
            runs.setdefault("from scratch, full data", []).append(
                one_run(base, args.work, f"scratch-s{seed}", full, settings)
            )
    for arm, rows in runs.items():
        print(f"  {arm}: " + ", ".join(f"{r['name']} {r['steps']} steps {r['wall_s']} s" for r in rows))
    print(table(runs, args.select_steps))


if __name__ == "__main__":
    main()
