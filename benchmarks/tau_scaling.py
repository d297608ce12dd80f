"""Checks the τ-scaling fit (``drafter/evaluate/scaling.py``) against a real run on the embedded default:
train on half of the distinct training rows, predict τ at the full data from that run's checkpoint
curve, train on the full data, and print predicted against measured τ per dataset.

Both runs take the local profile's drafter settings (epochs, lr, batch, sequence length, seed) and
differ only in the data, so the schedule per token is the same: the half run has half the steps.
``--checkpoint-every`` (default 10) replaces the profile's 60, which leaves the full run 3 curve
points, fewer than the fit needs; checkpointing more often changes nothing else (the evaluation
draws no random numbers). The half is taken per dataset (a seeded random half of each dataset's
train rows) so every dataset keeps its share; the eval rows are the same in both runs. The
prediction for dataset X is the half run's fit at N_half · D_full/D_half (its tokens seen scaled by
the growth of its distinct training tokens), exactly what the planner's table assumes for "more data
of X".

The store is the embedded default's (``eagle3-pipeline run`` writes it under the artifacts root it
prints; ``--artifacts`` names another); the half store is a second index over the same shard files
(symlinks) under ``--work``, where both runs' checkpoints go too (a rerun with the same --work
resumes them: nothing is trained again).

    .venv/bin/python -m benchmarks.tau_scaling [--artifacts DIR] [--work DIR] [--checkpoint-every 10]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_pipeline.config import load_config, local_profile_path
from eagle3_pipeline.drafter.evaluate.acceptance import ALL
from eagle3_pipeline.drafter.evaluate.scaling import NoFit, fit_curve
from eagle3_pipeline.drafter.spec import train_spec
from eagle3_pipeline.drafter.train.phase import run


class Log:
    def __init__(self, name: str) -> None:
        self.name = name

    def log(self, message: str) -> None:
        if message.startswith(("training", "resuming", "exported")):
            print(f"  [{self.name}] {message}", flush=True)

    def progress(self, metrics: Any) -> None:
        return None


def half_store(store: Path, folder: Path, seed: int) -> Path:
    """The store with a seeded random half of each dataset's train rows (eval rows all kept)."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in store.iterdir():
        if source.name != "index.parquet" and not (folder / source.name).exists():
            (folder / source.name).symlink_to(source.resolve())
    rows = pq.read_table(store / "index.parquet").to_pylist()
    rng = random.Random(seed)
    kept = []
    for dataset in sorted({r["dataset"] for r in rows}):
        train = [r for r in rows if r["dataset"] == dataset and r["split"] == "train"]
        kept += rng.sample(train, len(train) // 2)
    keep = {id(r) for r in kept}
    table = [r for r in rows if r["split"] != "train" or id(r) in keep]
    pq.write_table(
        pa.Table.from_pylist(table, schema=pq.read_schema(store / "index.parquet")), folder / "index.parquet"
    )
    return folder


def train(spec: dict[str, Any], name: str) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    result = run(spec, Log(name))
    return result["tau_curve"], time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", type=Path, help="default: the embedded default's artifacts root")
    parser.add_argument("--work", type=Path, default=Path("/tmp/eagle3_tau_scaling"))
    parser.add_argument("--checkpoint-every", type=int, default=10)
    args = parser.parse_args()
    config = load_config(local_profile_path())
    args.artifacts = args.artifacts or config.artifacts_root
    base = train_spec(config, args.artifacts.resolve())
    if not Path(base["store"], "index.parquet").is_file():
        sys.exit(f"no hidden-state store under {args.artifacts}: run `eagle3-pipeline run` first (or pass --artifacts)")
    settings = {**base["settings"], "checkpoint_every": args.checkpoint_every}
    specs = {}
    for name, store in (
        ("half", half_store(Path(base["store"]), args.work / "half_store", settings["seed"])),
        ("full", Path(base["store"])),
    ):
        specs[name] = {
            **base,
            "store": str(store),
            "run_dir": str(args.work / name / "run"),
            "export_dir": str(args.work / name / "export"),
            "settings": settings,
        }
    print(f"local profile drafter: {settings['epochs']} epochs, lr {settings['lr']}, batch_tokens "
          f"{settings['batch_tokens']}, max_seq_len {settings['max_seq_len']}, ttt_steps {settings['ttt_steps']}; "
          f"checkpoint every {args.checkpoint_every} steps")  # fmt: skip
    half, half_s = train(specs["half"], "half")
    full, full_s = train(specs["full"], "full")
    print(
        f"half run: {half['points'][-1]['step']} steps in {half_s:.0f} s; full run: "
        f"{full['points'][-1]['step']} steps in {full_s:.0f} s"
    )

    k = half["k"]
    print(f"\ncurves (τ@{k} per checkpoint: step, tokens seen, τ by dataset)")
    for name, curve in (("half", half), ("full", full)):
        for p in curve["points"]:
            print(
                f"  {name} {p['step']:>4} {p['tokens']:>7}  " + "  ".join(f"{d} {t:.3f}" for d, t in p["tau"].items())
            )

    fits = fit_curve(half)
    header = [
        "dataset",
        "half: train tokens",
        "points",
        f"half τ@{k}",
        "full: train tokens",
        f"predicted τ@{k} [95 %]",
        f"measured τ@{k}",
        "inside",
    ]
    lines = [header]
    notes = []
    data_half = {**half["data_tokens"], ALL: sum(half["data_tokens"].values())}
    data_full = {**full["data_tokens"], ALL: sum(full["data_tokens"].values())}
    for dataset, fit in fits.items():
        last = half["points"][-1]
        measured = full["points"][-1]["tau"].get(dataset)
        cells = [dataset, f"{data_half[dataset]:,}", str(sum(dataset in p["tau"] for p in half["points"])),
                 f"{last['tau'][dataset]:.3f}" if dataset in last["tau"] else "—",
                 f"{data_full.get(dataset, 0):,}"]  # fmt: skip
        if isinstance(fit, NoFit):
            cells += ["no figure", "—" if measured is None else f"{measured:.3f}", ""]
            notes.append(f"{dataset}: {fit.reason}")
        else:
            target = fit.n_last * data_full[dataset] / data_half[dataset]
            predicted = fit.predict(target)
            inside = measured is not None and predicted.low <= measured <= predicted.high
            cells += [predicted.text(), "—" if measured is None else f"{measured:.3f}", "yes" if inside else "no"]
            notes.append(
                f"{dataset}: half-run fit τ∞ {fit.tau_inf:.3f}, a {fit.a:.3f}, b {fit.b:.2f}, residual sd "
                f"{fit.residual_sd:.4f}, {fit.eval_steps} eval verify steps"
            )
        lines.append(cells)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    print("\nprediction from the half-data run against the full-data run")
    for row in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print("\n".join(notes))


if __name__ == "__main__":
    main()
