"""The training loop (SpecForge's ``TrainerController`` over its ``TrainerCore``): the scheduled batches in
order, one optimizer step each (:meth:`Trainer.train_step`), a curve point every ``log_every`` steps
and a checkpoint every ``checkpoint_every`` (evaluated, with its τ-curve point) and at the end. With
``select: best`` the weights of the checkpoint with the best τ so far are kept apart (:data:`BEST_FILE`).
A warm start with ``init_l2sp`` adds the L2-SP pull toward the start's weights to each step's objective.

Metrics stay on the device and are synced (and all-reduced over the ranks) once per curve point. Only
rank 0 evaluates and writes checkpoints.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.drafter.evaluate.scaling import curve_point, tokens_seen, write_curve
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
from eagle3_pipeline.drafter.spec import TrainSettings
from eagle3_pipeline.drafter.train.backend import Optimization, Ranks, rank_rows, rng_state
from eagle3_pipeline.drafter.train.checkpoint import save_checkpoint
from eagle3_pipeline.drafter.train.data import Batch, BatchReader
from eagle3_pipeline.drafter.train.epochs import TrainingSchedule
from eagle3_pipeline.drafter.train.loss import StepMetrics, evaluate, ttt_loss
from eagle3_pipeline.drafter.train.warm_start import l2sp_penalty


@dataclass
class RunState:
    """Where a run is in its batch order and what it has measured: what a checkpoint holds besides the
    weights, the optimizer and the RNG."""

    step: int
    epoch: int
    batch_index: int
    curve: list[dict[str, float]]
    evals: list[dict[str, float]]
    tau_curve: dict[str, Any]
    start: dict[str, Any] | None = None  # a warm start: where from, and its eval before the first step


@dataclass
class Trainer:
    """The model and what one training step needs (SpecForge's ``TrainerCore``)."""

    model: Eagle3Drafter
    forward: Callable[..., list[torch.Tensor]]  # the model, or its DistributedDataParallel wrapper
    optimization: Optimization
    lm_head: torch.Tensor
    device: torch.device
    autocast: torch.dtype | None
    ranks: Ranks
    settings: TrainSettings
    anchor: dict[str, torch.Tensor] | None = None  # θ₀ of the L2-SP pull (drafter.init_l2sp), None: off

    def precision(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=self.autocast or torch.float32, enabled=self.autocast is not None)

    def train_step(self, batch: Batch) -> StepMetrics:
        """Loss of one batch (this rank's share), backward, clipped optimizer and schedule step."""
        batch = batch.to(self.device)
        with self.precision():
            metrics = ttt_loss(
                self.model,
                batch,
                lm_head=self.lm_head,
                steps=self.settings.ttt_steps,
                ranks=self.ranks,
                forward=self.forward,
                activation_checkpointing=self.settings.activation_checkpointing,
                loss_kind=self.settings.loss,
                eta=self.settings.lk_eta,
            )
        objective = metrics.loss
        if self.anchor is not None:
            # Every rank adds the whole term; the optimizer step scales by the ranks, which average it.
            objective = objective + self.settings.init_l2sp * l2sp_penalty(self.model, self.anchor) / self.ranks.world
        self.optimization.step(objective)
        metrics.loss = metrics.loss.detach()  # the curve's loss is the data term
        return metrics


class Window:
    """The metrics of the steps since the last curve point, summed on the device (no host sync
    per step): loss, then per TTT step hits and trained positions, then tokens."""

    def __init__(self, steps: int, device: torch.device) -> None:
        self.steps = steps
        self.sums = torch.zeros(1 + 2 * steps + 1, device=device)
        self.count = 0
        self.started = time.monotonic()

    def add(self, metrics: StepMetrics, tokens: int) -> None:
        self.sums[0] += metrics.loss
        self.sums[1 : 1 + self.steps] += metrics.hits
        self.sums[1 + self.steps : 1 + 2 * self.steps] += metrics.trained
        self.sums[-1] += tokens
        self.count += 1

    def row(self, step: int, lr: float, ranks: Ranks) -> tuple[dict[str, float], int]:
        """The curve point (summed over the ranks: one sync) and the tokens trained in the window."""
        values = ranks.all_reduce(self.sums.clone()).tolist()
        n, s = self.count, self.steps
        elapsed = max(time.monotonic() - self.started, 1e-9)
        tokens = int(values[-1])
        row: dict[str, float] = {
            "step": step,
            "loss": values[0] / n,
            "lr": lr,
            "tokens_per_s": round(tokens / elapsed, 1),
        }
        row.update({f"acc_{j}": values[1 + j] / max(values[1 + s + j], 1.0) for j in range(s)})
        return row, tokens


BEST_FILE = "best.pt"


def best_eval(evals: list[dict[str, float]], k: int) -> dict[str, float] | None:
    """The evaluated checkpoint with the highest τ@k (the later one on a tie), None before any."""
    key = f"tau@{k}"
    scored = [e for e in evals if key in e]
    return max(reversed(scored), key=lambda e: e[key]) if scored else None


def save_best(run_dir: Path, step: int, weights: dict[str, torch.Tensor]) -> None:
    """The best checkpoint's weights (``select: best``), beside the rotated checkpoints, which may
    delete it; written under a temporary name and renamed into place."""
    path = Path(run_dir) / BEST_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"step": torch.tensor(step), "model": weights}, tmp)
    os.replace(tmp, path)


@dataclass
class Checkpointer:
    """Rank 0's checkpoint: evaluate on the eval batches, add the τ-curve point and write the curve,
    then the checkpoint (weights without the frozen target embedding, optimizer, RNG, run state)."""

    trainer: Trainer
    schedule: TrainingSchedule
    store: Path
    run_dir: Path
    identity: dict[str, Any]
    vocab: tuple[torch.Tensor, torch.Tensor]  # d2t, t2d
    tau_k: int

    def save(self, state: RunState, report: Reporter) -> None:
        trainer, settings = self.trainer, self.trainer.settings
        reader = BatchReader(self.store, settings.max_seq_len)
        metrics, acceptance = evaluate(
            trainer.model,
            reader,
            eval_batches=self.schedule.eval_batches,
            lm_head=trainer.lm_head,
            settings=settings,
            device=trainer.device,
            autocast=trainer.autocast,
        )
        state.evals.append({"step": state.step, **metrics})
        if acceptance:
            seen = tokens_seen(self.schedule.batches, state.epoch, state.batch_index, self.schedule.tokens_of)
            state.tau_curve["points"].append(curve_point(state.step, seen, acceptance, self.tau_k))
        write_curve(
            self.run_dir, state.tau_curve
        )  # before the checkpoint: never behind it (a resume recomputes the point)
        model = trainer.model
        weights = {
            k: v for k, v in model.state_dict().items() if not (k == "embed_tokens.weight" and model.embedding_frozen)
        }
        best = best_eval(state.evals, settings.select_steps)
        if settings.select == "best" and best is not None and best["step"] == state.step:
            save_best(self.run_dir, state.step, weights)
        checkpoint = {
            "model": weights,
            **trainer.optimization.state_dict(),
            "rng": rng_state(),
            "step": state.step,
            "epoch": state.epoch,
            "batch_index": state.batch_index,
            "world_size": trainer.ranks.world,
            "curve": state.curve,
            "evals": state.evals,
            "tau_curve": state.tau_curve,
            "start": state.start,
            "identity": self.identity,
        }
        d2t, t2d = self.vocab
        where = save_checkpoint(self.run_dir, state.step, checkpoint, d2t, t2d, settings.keep_checkpoints)
        rounded = {k: round(v, 4) for k, v in state.evals[-1].items()}
        report.log(f"checkpoint {where.name} written; eval {json.dumps(rounded)}")


@dataclass(frozen=True)
class LoopTimes:
    trained_tokens: int
    loop_s: float  # training time, checkpoints excluded
    checkpoint_s: float


def train_loop(
    trainer: Trainer,
    schedule: TrainingSchedule,
    state: RunState,
    reader: BatchReader,
    checkpointer: Checkpointer,
    report: Reporter,
) -> LoopTimes:
    """Train from ``state``'s position to the schedule's end (or ``max_steps``, or the rolling segment's end),
    advancing ``state`` in place."""
    settings, ranks = trainer.settings, trainer.ranks
    window = Window(settings.ttt_steps, trainer.device)
    trained_tokens, checkpoint_s = 0, 0.0
    loop_started = time.monotonic()
    trainer.model.train()
    while state.step < schedule.total_steps and state.epoch < schedule.limit:
        if state.batch_index >= len(schedule.batches[state.epoch]):
            state.epoch, state.batch_index = state.epoch + 1, 0
            continue
        rows, real = rank_rows(schedule.batches[state.epoch][state.batch_index], ranks)
        batch = reader.read(rows)
        if not real:
            batch.loss_mask.zero_()
        tokens = batch.tokens if real else 0
        window.add(trainer.train_step(batch), tokens)
        state.step += 1
        state.batch_index += 1
        if state.step % settings.log_every == 0 or state.step == schedule.total_steps:
            row, window_tokens = window.row(state.step, trainer.optimization.lr, ranks)
            trained_tokens += window_tokens
            state.curve.append(row)
            report.progress({**row, "total_steps": schedule.total_steps, "epoch": state.epoch})
            window = Window(settings.ttt_steps, trainer.device)
        segment_end = schedule.layout is not None and state.batch_index == len(schedule.batches[state.epoch])
        every = state.step % settings.checkpoint_every == 0 or state.step == schedule.total_steps
        if ranks.leader and (every or segment_end):
            started = time.monotonic()
            checkpointer.save(state, report)
            checkpoint_s += time.monotonic() - started
    return LoopTimes(trained_tokens, time.monotonic() - loop_started - checkpoint_s, checkpoint_s)
