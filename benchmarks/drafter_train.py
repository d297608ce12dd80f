"""Training throughput of the drafter: our training loop against a bare PyTorch loop.

Both train the same model (same seed, same config) on the same batches for the same number of
steps in this process, alternately (``--rounds``: bare, ours, bare, ours, ...; the best rate of
each is compared, as load from other processes on a shared machine slows whichever runs then).
Ours is ``eagle3_pipeline.drafter.train.run``: it reads each batch from the hidden-state store,
logs metrics, and checkpoints at the end (checkpoint time excluded; it is printed apart). The
bare loop has every batch in memory already and does only teacher + TTT forward + loss + backward
+ clip + AdamW step. Prints tokens/s of both and the ratio (goal: >= 0.8).
Our loop's loss, accuracy and token sums stay on the device and are synced every ``log_every``
steps (here 5).

The store comes from the embedded model's hidden states over the shipped prompts (built once into
--work, reused on later runs).

    .venv/bin/python benchmarks/drafter_train.py [--samples 200] [--steps 12] [--rounds 2] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_pipeline.drafter.data import BatchReader, epoch_plan, store_rows, teacher  # noqa: E402
from eagle3_pipeline.drafter.target import load_target_weights  # noqa: E402
from eagle3_pipeline.drafter.train import ADAM_BETAS, build_model, drafter_config, run  # noqa: E402
from eagle3_pipeline.hidden_states.store import HiddenStateStore, load_draft_vocab  # noqa: E402
from eagle3_pipeline.serving import local_model_dir  # noqa: E402
from eagle3_pipeline_tests.drafter.tiny_store import real_store  # noqa: E402


class Quiet:
    def log(self, message: str) -> None:
        print(f"  [ours] {message}")

    def progress(self, metrics: Any) -> None:
        return None


def bare_loop(store: Path, vocab: Path, target_dir: Path, settings: dict[str, Any], steps: int) -> tuple[int, float]:
    d2t, t2d, _ = load_draft_vocab(vocab)
    target = load_target_weights(target_dir)
    manifest = HiddenStateStore(store).manifest()
    model = build_model(drafter_config(target.config, int(d2t.shape[0]), manifest.aux_layer_ids, {}), target, d2t, t2d, settings["seed"])
    plan = epoch_plan(store_rows(HiddenStateStore(store), "train"), settings["seed"], 0, settings["batch_tokens"], settings["max_seq_len"])
    reader = BatchReader(store, settings["max_seq_len"])
    batches = [reader.read(rows) for rows in plan[:steps]]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings["lr"], betas=ADAM_BETAS)
    lm_head = target.lm_head.float()
    tokens = 0
    started = time.monotonic()
    for batch in batches:
        target_signal = teacher(batch.hidden, lm_head, model.t2d, F.pad(batch.loss_mask[:, 1:], (0, 1)))
        masks = [
            F.pad(batch.loss_mask[:, j + 2 :], (0, j + 2)).float() * model.t2d[F.pad(target_signal.argmax[:, j + 1 :], (0, j + 1))].float()
            for j in range(settings["ttt_steps"])
        ]
        keep = [mask.bool() for mask in masks]
        logits = model.ttt_forward(batch.aux, batch.input_ids, settings["ttt_steps"], batch.attention_mask, keep)
        loss = torch.zeros(())
        for j, step_logits in enumerate(logits):
            probs = F.pad(target_signal.probs[:, j + 1 :], (0, 0, 0, j + 1))[keep[j]]
            ce = -(probs * torch.log_softmax(step_logits, -1)).sum()
            loss = loss + 0.8**j * ce / masks[j].sum().clamp(min=1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings["grad_clip"])
        optimizer.step()
        tokens += batch.tokens
    return tokens, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--draft-vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2, help="bare then ours, this many times; the best rate of each is compared")
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "eagle3-drafter-bench")
    args = parser.parse_args()
    store, vocab, target_dir = args.work / "store", args.work / "vocab", local_model_dir()
    if not (store / "manifest.json").is_file():
        started = time.monotonic()
        real_store(store, vocab, target_dir, args.samples, args.draft_vocab)
        print(f"built a store of {args.samples} samples from the embedded model in {time.monotonic() - started:.1f} s")
    settings = {"ttt_steps": 7, "lr": 1e-3, "batch_tokens": args.batch_tokens, "max_seq_len": 256, "grad_clip": 0.5, "seed": 0, "epochs": 1,
                "max_steps": args.steps, "checkpoint_every": 10**9, "log_every": 5, "eval_samples": 8}  # fmt: skip
    load_before = os.getloadavg()[0]
    bare_rates, our_rates = [], []
    for round_number in range(1, args.rounds + 1):  # alternate the loops: load from other processes hits both alike
        bare_tokens, bare_s = bare_loop(store, vocab, target_dir, settings, args.steps)
        run_dir = Path(tempfile.mkdtemp(prefix="drafter-bench-run-"))
        spec = {"store": str(store), "draft_vocab": str(vocab), "target_weights": str(target_dir), "run_dir": str(run_dir / "run"),
                "export_dir": str(run_dir / "export"), "settings": settings}  # fmt: skip
        ours = run(spec, Quiet())
        assert ours["trained_tokens_this_run"] == bare_tokens, "the loops trained on different tokens"
        bare_rates.append(bare_tokens / bare_s)
        our_rates.append(ours["tokens_per_s"])
        print(f"round {round_number}: {ours['steps']} steps, {bare_tokens} tokens; bare {bare_rates[-1]:.1f} tokens/s ({bare_s:.1f} s), "
              f"ours {our_rates[-1]:.1f} tokens/s ({ours['train_loop_s']:.1f} s; checkpoint+eval {ours['checkpoint_s']:.1f} s apart)")  # fmt: skip
    print(f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"bare PyTorch loop : {max(bare_rates):10.1f} tokens/s (best of {args.rounds})")
    print(f"our training loop : {max(our_rates):10.1f} tokens/s (best of {args.rounds})")
    print(f"ratio ours/bare   : {max(our_rates) / max(bare_rates):.3f} (goal >= 0.8)")
    print(f"loss first {ours['first_loss']:.4f} -> last {ours['last_loss']:.4f}")

if __name__ == "__main__":
    main()
