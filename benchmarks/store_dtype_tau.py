"""What an fp8 hidden-state store costs in τ on the embedded default: bf16 store against fp8 store.

One bf16 store is built from the embedded model (SmolLM2-135M-Instruct) over the shipped prompt sets
(``eagle3_pipeline/testing/tiny_store.py:real_store``: ``--samples`` prompts, at most
``--max-tokens`` tokens each, every 10th sample in the eval split); the fp8 store holds the same
samples in the same shards, written by ``ShardWriter(dtype="float8_e4m3")`` from the bf16 states (as
the phase does: the target's states arrive in bf16 and are quantized when the shard is written).
Both stores share one draft vocabulary. The drafter is then trained on each with the same seed, the
same steps and the same settings (the local profile's drafter: lr, batch_tokens, max_seq_len,
ttt_steps, seed; ``--epochs`` replaces its 12, default 6: with the default 120 prompts of at most
128 tokens the two runs and the store fit in about half an hour on a two-core machine shared with
other jobs), and ``drafter_eval``'s function (``eagle3_pipeline.drafter.evaluate.phase:run``,
K = 3, 5, 7) measures τ per dataset on each store's eval split, i.e. each drafter reads its states
from the store of its own dtype, as a deployment with that storage dtype would.

Prints: bytes/token of each store (measured and by formula), the largest relative error (L2 per
sample and tensor, as the phase's spot check computes it) of the dequantized fp8 states against
the bf16 ones for the aux layers and the teacher, how often the teacher's full-vocabulary argmax
from fp8 states equals the one from bf16 states (and the bf16 top-1/top-2 margin where it does
not), KL and total variation between the two teacher distributions, both τ tables, and τ(fp8) / τ(bf16) per
dataset and K.

    .venv/bin/python -m benchmarks.store_dtype_tau [--samples 120] [--max-tokens 128] [--epochs 6] [--work DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.tau_scaling import Log  # the same quiet reporter as the τ-scaling benchmark
from eagle3_pipeline.config import load_config, local_profile_path
from eagle3_pipeline.drafter.evaluate import phase as evaluate
from eagle3_pipeline.drafter.spec import train_spec
from eagle3_pipeline.drafter.train import phase as train
from eagle3_pipeline.hidden_states.store import BF16, FP8, HiddenStateStore, ShardWriter, bytes_per_token
from eagle3_pipeline.target.local_model import prepare_local_model
from eagle3_pipeline.target.weights import load_target_weights
from eagle3_pipeline.testing.tiny_store import real_store


def convert(source: HiddenStateStore, root: Path, dtype: str) -> HiddenStateStore:
    """The same samples in the same shards, written in ``dtype``."""
    manifest = source.manifest()
    writers: dict[str, ShardWriter] = {}
    rows = source.index().to_pylist()
    shard_of = {row["sample_id"]: row["shard"] for row in rows}
    total = 0
    for sample in source.iter_samples():
        name = shard_of[sample.sample_id]
        if name not in writers:
            total += sum(w.close() for w in writers.values())
            writers = {name: ShardWriter(root, int(name.split("-")[1]), dtype)}
        writers[name].add(
            sample.sample_id,
            sample.dataset,
            split=sample.split,
            input_ids=sample.input_ids,
            loss_mask=sample.loss_mask,
            aux=sample.aux_hidden_states,
            hidden=sample.hidden_states,
        )
    total += sum(w.close() for w in writers.values())
    store = HiddenStateStore(root)
    store.write_index(manifest.shards)
    manifest.dtype, manifest.bytes = dtype, total
    store.write_manifest(manifest)
    return store


def relative_error(found: torch.Tensor, expected: torch.Tensor) -> float:
    return float((found.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-30))


def compare(bf16: HiddenStateStore, fp8: HiddenStateStore, lm_head: torch.Tensor) -> dict[str, float]:
    """Largest relative errors of the dequantized states, and what the fp8 teacher does to the
    target's distribution: argmax agreement, the bf16 top-1/top-2 probability margin where the
    argmax flips, KL(bf16 ‖ fp8) and total variation per token."""
    worst_aux = worst_hidden = 0.0
    margins, flips, kls, tvs = [], [], [], []
    for a, b in zip(bf16.iter_samples(), fp8.iter_samples(), strict=True):
        assert a.sample_id == b.sample_id and torch.equal(a.input_ids, b.input_ids)
        worst_aux = max(worst_aux, relative_error(b.aux_hidden_states, a.aux_hidden_states))
        worst_hidden = max(worst_hidden, relative_error(b.hidden_states, a.hidden_states))
        logits_a, logits_b = a.hidden_states.float() @ lm_head.T, b.hidden_states.float() @ lm_head.T
        p_a, log_a, log_b = logits_a.softmax(-1), logits_a.log_softmax(-1), logits_b.log_softmax(-1)
        top = p_a.topk(2, -1).values
        margins.append(top[:, 0] - top[:, 1])
        flips.append(logits_a.argmax(-1) != logits_b.argmax(-1))
        kls.append((p_a * (log_a - log_b)).sum(-1))
        tvs.append(0.5 * (p_a - log_b.exp()).abs().sum(-1))
    margin, flip, kl, tv = torch.cat(margins), torch.cat(flips), torch.cat(kls), torch.cat(tvs)
    return {"aux": worst_aux, "hidden": worst_hidden, "argmax_same": 1 - float(flip.float().mean()),
            "tokens": flip.numel(), "margin_all": float(margin.median()),
            "margin_flips": float(margin[flip].median()) if flip.any() else float("nan"),
            "flips_close": float((margin[flip] < 0.05).float().mean()) if flip.any() else float("nan"),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "tv_mean": float(tv.mean()),
            "tv_max": float(tv.max())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-vocab", type=int, default=2048, help="the local profile's draft_vocab.size")
    parser.add_argument("--epochs", type=int, default=6, help="replaces the local profile's drafter.epochs (12)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "eagle3-store-dtype-tau")
    args = parser.parse_args()
    config = load_config(local_profile_path())
    target_dir, _ = prepare_local_model()
    vocab = args.work / "vocab"
    stores = {BF16: HiddenStateStore(args.work / BF16), FP8: HiddenStateStore(args.work / FP8)}
    started = time.monotonic()
    if not stores[BF16].index_path.is_file():
        real_store(
            stores[BF16].root,
            vocab,
            model_dir=target_dir,
            samples=args.samples,
            draft_vocab_size=args.draft_vocab,
            max_tokens=args.max_tokens,
        )
    if not stores[FP8].index_path.is_file():
        convert(stores[BF16], stores[FP8].root, FP8)
    print(f"stores built in {time.monotonic() - started:.0f} s under {args.work}")

    target = load_target_weights(target_dir)
    hidden = target.hidden_size
    print(f"\nstore bytes/token (target hidden {hidden}, 3 aux layers + teacher)")
    for dtype, store in stores.items():
        m = store.manifest()
        print(
            f"  {dtype:<12} {m.samples} samples, {m.tokens} tokens, {m.bytes:,} B: {m.bytes_per_token:,.1f} B/token "
            f"(formula {bytes_per_token(hidden, 3, dtype):,})"
        )
    print(f"  fp8 / bf16 bytes: {stores[FP8].manifest().bytes / stores[BF16].manifest().bytes:.4f}")
    errors = compare(stores[BF16], stores[FP8], target.lm_head.float())
    print(
        f"\nfp8 dequantized vs bf16 (max relative L2 error per sample and tensor): aux {errors['aux']:.4f}, "
        f"teacher {errors['hidden']:.4f}"
    )
    print(
        "teacher's full-vocabulary argmax from fp8 states equals the bf16 one at "
        f"{errors['argmax_same']:.4%} of {errors['tokens']} tokens"
    )
    print("  where it flips, the bf16 teacher's top-1 − top-2 probability margin has median "
          f"{errors['margin_flips']:.4f} (all tokens: {errors['margin_all']:.4f}); {errors['flips_close']:.1%} of the "
          "flips have a margin below 0.05")  # fmt: skip
    print(f"  KL(bf16 ‖ fp8) of the teacher's distribution: mean {errors['kl_mean']:.5f} "
          f"nats, max {errors['kl_max']:.4f}; total variation mean "
          f"{errors['tv_mean']:.4f}, max {errors['tv_max']:.4f}")  # fmt: skip

    base = train_spec(config, args.work)
    settings = {**base["settings"], "epochs": args.epochs}
    print(f"\ndrafter: {settings['epochs']} epochs, lr {settings['lr']}, batch_tokens "
          f"{settings['batch_tokens']}, max_seq_len {settings['max_seq_len']}, ttt_steps "
          f"{settings['ttt_steps']}, seed {settings['seed']} (same for both stores)")  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    for dtype, store in stores.items():
        out = args.work / f"run-{dtype}"
        spec = {**base, "store": str(store.root), "draft_vocab": str(vocab), "target_weights": str(target_dir),
                "run_dir": str(out / "run"), "export_dir": str(out / "export"), "settings": settings}  # fmt: skip
        t0 = time.monotonic()
        trained = train.run(spec, Log(dtype))
        t1 = time.monotonic()
        eval_spec = {"store": str(store.root), "draft_vocab": str(vocab), "drafter": str(out / "export"),
                     "target_weights": str(target_dir), **evaluate.spec_settings(config.drafter_eval, config.drafter),
                     "device": "cpu"}  # fmt: skip
        results[dtype] = evaluate.run(eval_spec, Log(dtype))
        print(
            f"  [{dtype}] trained {trained['steps']} steps in {t1 - t0:.0f} s (loss {trained['first_loss']:.3f} → "
            f"{trained['last_loss']:.3f}), evaluated in {time.monotonic() - t1:.0f} s",
            flush=True,
        )

    for dtype in stores:
        print(f"\nτ table, {dtype} store\n{results[dtype]['table']}")
    keys = sorted(k for k in results[BF16] if k.startswith("tau@") and k in results[FP8])
    print("\nτ(fp8 store) / τ(bf16 store)")
    for key in keys:
        a, b = results[BF16][key], results[FP8][key]
        print(f"  {key:<20} bf16 {a:.3f}  fp8 {b:.3f}  ratio {b / a:.4f}")


if __name__ == "__main__":
    main()
