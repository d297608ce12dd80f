"""Train the EAGLE-3 drafter on the hidden-state store: the ``train`` heavy phase (``run(spec, report)``),
its lifecycle: open the inputs, order the reads, build (from a warm start:
:mod:`~eagle3_pipeline.drafter.train.warm_start`) or resume the drafter, run the loop, export.

The roles, as SpecForge's ``training/DESIGN.md`` names them: the lifecycle is here; the loop and one
step in :mod:`~eagle3_pipeline.drafter.train.loop`; the EAGLE-3 loss in :mod:`~eagle3_pipeline.drafter.train.loss`;
processes, device, optimizer and RNG in :mod:`~eagle3_pipeline.drafter.train.backend`; what is read in which
order in :mod:`~eagle3_pipeline.drafter.train.epochs`. drafter/DESIGN.md says how resume, several processes
and rolling windows work.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.drafter.evaluate.scaling import new_curve
from eagle3_pipeline.drafter.export.specforge import export_for_servers
from eagle3_pipeline.drafter.model.draft_config import DrafterConfig, drafter_config
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
from eagle3_pipeline.drafter.spec import TrainError, TrainSettings, parse_spec
from eagle3_pipeline.drafter.train.backend import (
    Optimization,
    Ranks,
    distributed,
    join_ranks,
    pick_device,
    set_rng_state,
)
from eagle3_pipeline.drafter.train.checkpoint import latest_checkpoint, load_checkpoint
from eagle3_pipeline.drafter.train.data import BatchReader
from eagle3_pipeline.drafter.train.epochs import TrainingSchedule, schedule_run
from eagle3_pipeline.drafter.train.loop import (
    BEST_FILE,
    Checkpointer,
    LoopTimes,
    RunState,
    Trainer,
    best_eval,
    train_loop,
)
from eagle3_pipeline.drafter.train.loss import eval_depths, evaluate
from eagle3_pipeline.drafter.train.warm_start import WarmStart, read_start
from eagle3_pipeline.hidden_states.sharding import read_rolling_layout
from eagle3_pipeline.hidden_states.store import HiddenStateStore, load_draft_vocab
from eagle3_pipeline.target.weights import TargetWeights, load_target_weights


def run(spec: dict[str, Any], report: Reporter) -> dict[str, Any]:
    """The ``train`` phase. Returns JSON-able metadata (curve, first/last loss, eval, export); under
    torchrun every rank runs it and rank 0's metadata is the run's (the others report nothing)."""
    started = time.monotonic()
    ranks = join_ranks()
    try:
        return _train(spec, report, ranks, started)
    finally:
        if ranks.world > 1:
            torch.distributed.destroy_process_group()


@dataclass(frozen=True)
class Inputs:
    """What the run reads: the store, the draft vocabulary and the target's weights, checked against
    each other, and the draft model's config they make."""

    store: HiddenStateStore
    d2t: torch.Tensor
    t2d: torch.Tensor
    target: TargetWeights
    config: DrafterConfig


def _train(spec: dict[str, Any], report: Reporter, ranks: Ranks, started: float) -> dict[str, Any]:
    paths, settings = parse_spec(spec)
    inputs = open_inputs(paths, settings)
    layout = read_rolling_layout(paths["store"]) if spec.get("rolling") is not None else None
    schedule = schedule_run(inputs.store, layout, spec.get("rolling"), settings)
    trainer, start = start_trainer(inputs, settings, schedule, ranks)
    identity = {
        "settings": settings.identity(),
        "drafter": inputs.config.to_dict(),
        "store": inputs.store.manifest().identity(),
        "draft_vocab_sha256": vocab_sha256(inputs.d2t, inputs.t2d),
        "rolling": None if layout is None else layout.identity(),
        "init_from_sha256": None if start is None else start.digest,  # None: as a run from before the setting
    }
    tau_k = eval_depths(settings.ttt_steps)[0]
    fresh = RunState(0, 0, 0, [], [], new_curve(tau_k, settings.epochs, schedule.data_tokens))
    state = resume(paths, trainer, inputs=inputs, identity=identity, fresh=fresh, schedule=schedule, report=report)
    resumed_from = None if state is fresh else state.step
    enter_segment(state, schedule, paths, report)
    reader = BatchReader(paths["store"], settings.max_seq_len)
    if start is not None and state is fresh and ranks.leader:
        state.start = evaluate_start(trainer, start, reader, schedule, report)
    vocab = (inputs.d2t, inputs.t2d)
    checkpointer = Checkpointer(trainer, schedule, paths["store"], paths["run_dir"], identity, vocab, tau_k)
    times = train_loop(trainer, schedule, state, reader, checkpointer, report)
    result = run_metadata(
        state,
        resumed_from,
        schedule=schedule,
        times=times,
        trainer=trainer,
        inputs=inputs,
        export_dir=paths["export_dir"],
    )
    if not ranks.leader:
        return result
    if result["finished"]:
        training = select_checkpoint(trainer.model, state.evals, settings, paths["run_dir"])
        if state.start is not None:
            training["init_from"] = state.start
        result["selected"] = training
        model = trainer.model.to("cpu")
        export_for_servers(model, paths["export_dir"], inputs.target.config, settings.export_dtype, training)
        report.log(
            f"exported the drafter ({settings.select} checkpoint, step {training['step']}) to {paths['export_dir']} "
            f"after {time.monotonic() - started:.1f} s"
        )
    wall = time.monotonic() - started
    return {**result, "wall_s": round(wall, 2), "checkpoint": str(latest_checkpoint(paths["run_dir"]))}


def select_checkpoint(
    model: Eagle3Drafter, evals: list[dict[str, float]], settings: TrainSettings, run_dir: Path
) -> dict[str, Any]:
    """Load the exported checkpoint's weights into ``model`` (``select: best``: the best τ's, kept by the
    loop; ``last``: they are there) and say what was trained and chosen, for the export's metadata."""
    chosen = best_eval(evals, settings.select_steps) if settings.select == "best" else (evals or [None])[-1]
    if settings.select == "best" and chosen is not None:
        path = run_dir / BEST_FILE
        saved = torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None
        if saved is None or int(saved["step"]) != chosen["step"]:
            raise TrainError(
                f"{path}: select: best needs the weights of step {chosen['step']} (τ@{settings.select_steps} "
                f"{chosen[f'tau@{settings.select_steps}']:.4f}), which this run did not keep (a part of it ran with "
                f"select: last); export the last one (select: last), or remove {run_dir} to train anew"
            )
        model.load_state_dict(saved["model"], strict=False)
    key = f"tau@{settings.select_steps}"
    return {
        "loss": settings.loss,
        **({"lk_eta": settings.lk_eta} if settings.loss == "lk_lambda" else {}),
        "select": settings.select,
        "select_steps": settings.select_steps,
        "step": None if chosen is None else int(chosen["step"]),
        key: None if chosen is None or key not in chosen else round(chosen[key], 4),
    }


def open_inputs(paths: dict[str, Path], settings: TrainSettings) -> Inputs:
    """The store, the draft vocabulary and the target's weights; refused when they do not belong together."""
    store = HiddenStateStore(paths["store"])
    manifest = store.manifest()
    d2t, t2d, _ = load_draft_vocab(paths["draft_vocab"])
    target = load_target_weights(paths["target_weights"], settings.embedding_key, settings.lm_head_key)
    if manifest.target.hidden_size != target.hidden_size or manifest.target.vocab_size != target.vocab_size:
        raise TrainError(
            f"{paths['store']}: the store was made from a target with hidden {manifest.target.hidden_size}, "
            f"vocab {manifest.target.vocab_size}; {paths['target_weights']} has hidden "
            f"{target.hidden_size}, vocab {target.vocab_size}"
        )
    if t2d.shape[0] != target.vocab_size:
        raise TrainError(
            f"{paths['draft_vocab']}: t2d covers {t2d.shape[0]} tokens, the target vocabulary has {target.vocab_size}"
        )
    config = drafter_config(target.config, int(d2t.shape[0]), list(manifest.aux_layer_ids), settings.model_overrides())
    return Inputs(store, d2t, t2d, target, config)


def build_model(
    config: DrafterConfig, target: TargetWeights, d2t: torch.Tensor, t2d: torch.Tensor, seed: int
) -> Eagle3Drafter:
    """Fresh drafter: seeded init, the target's embedding frozen (trained when draft H != target H)."""
    torch.manual_seed(seed)
    model = Eagle3Drafter(config)
    if config.hidden_size == config.target_hidden_size:
        model.set_target_embedding(target.embedding.float())
    model.set_vocab(d2t, t2d)
    return model


def start_trainer(
    inputs: Inputs, settings: TrainSettings, schedule: TrainingSchedule, ranks: Ranks
) -> tuple[Trainer, WarmStart | None]:
    """A fresh drafter on this rank's device (from ``init_from``'s weights when set: a resume loads its
    checkpoint over them), its optimizer over the run's total steps, the target's lm_head; and the start."""
    device, autocast = pick_device(settings.dtype, ranks.local_rank)
    model = build_model(inputs.config, inputs.target, inputs.d2t, inputs.t2d, settings.seed)
    start = None if settings.init_from is None else read_start(Path(settings.init_from), model)
    if start is not None:
        start.apply(model)
    model = model.to(device)
    anchor = start.anchor(model) if start is not None and settings.init_l2sp else None
    lm_head = inputs.target.lm_head.to(device, autocast or torch.float32)
    optimization = Optimization(model, settings, schedule.total_steps, ranks)
    forward = distributed(model, ranks, device)
    return Trainer(model, forward, optimization, lm_head, device, autocast, ranks, settings, anchor), start


def evaluate_start(
    trainer: Trainer, start: WarmStart, reader: BatchReader, schedule: TrainingSchedule, report: Reporter
) -> dict[str, Any]:
    """The start's eval before the first step, as each checkpoint's is computed (τ at the eval depths,
    per-depth acceptance): the gain of the run is measured against it."""
    metrics, _ = evaluate(
        trainer.model,
        reader,
        eval_batches=schedule.eval_batches,
        lm_head=trainer.lm_head,
        settings=trainer.settings,
        device=trainer.device,
        autocast=trainer.autocast,
    )
    measured = {k: round(v, 4) for k, v in metrics.items() if k.startswith(("tau@", "accept_"))}
    report.log(f"warm start from {start.folder} ({start.format}, {start.lm_head_rows} lm_head rows): {measured}")
    return {**start.describe(), **measured}


def resume(
    paths: dict[str, Path],
    trainer: Trainer,
    *,
    inputs: Inputs,
    identity: dict[str, Any],
    fresh: RunState,
    schedule: TrainingSchedule,
    report: Reporter,
) -> RunState:
    """The run's state: from the latest complete checkpoint (weights, optimizer, RNG restored into
    ``trainer``) when its vocabulary and identity are this run's, else ``fresh``."""
    processes = _processes(trainer.ranks.world)
    found = latest_checkpoint(paths["run_dir"])
    if found is None:
        report.log(
            f"training a new drafter: {schedule.total_steps} steps over {len(schedule.train_rows)} samples, "
            f"{trainer.settings.epochs} epoch(s), device {trainer.device}, {processes}"
        )
        return fresh
    state, ck_d2t, ck_t2d = load_checkpoint(found)
    if not (torch.equal(ck_d2t, inputs.d2t) and torch.equal(ck_t2d, inputs.t2d)):
        raise TrainError(
            f"{found}: this drafter was trained with another draft vocabulary than {paths['draft_vocab']} (vocab "
            f"sha256 {state['identity']['draft_vocab_sha256'][:12]} vs {identity['draft_vocab_sha256'][:12]}); "
            "continuing would silently remap its lm_head. Restore the vocabulary it was trained with, or remove "
            f"{paths['run_dir']} to train a new drafter"
        )
    differ = sorted(k for k in identity if state["identity"].get(k) != identity[k])
    if differ:
        raise TrainError(
            f"{found}: made under other {', '.join(differ)} than this run; remove {paths['run_dir']} to train anew"
        )
    trainer.model.load_state_dict(state["model"], strict=False)
    trainer.optimization.load_state_dict(state)
    set_rng_state(state["rng"])
    # A run checkpointed before the τ curve existed starts one here.
    resumed = RunState(
        state["step"], state["epoch"], state["batch_index"], state["curve"], state["evals"],
        state.get("tau_curve", fresh.tau_curve), state.get("start"),
    )  # fmt: skip
    written_by = state.get("world_size", 1)
    other = (
        ""
        if written_by == trainer.ranks.world
        else f" (the checkpoint was written by a run of {_processes(written_by)})"
    )
    report.log(
        f"resuming from {found.name}: step {resumed.step}/{schedule.total_steps}, epoch {resumed.epoch}, "
        f"batch {resumed.batch_index}, {processes}{other}"
    )
    return resumed


def enter_segment(state: RunState, schedule: TrainingSchedule, paths: dict[str, Path], report: Reporter) -> None:
    """A rolling run trains the segment it is asked for: its data position must lie within it, else a
    window would be trained twice or skipped."""
    if schedule.layout is None or state.step >= schedule.total_steps:
        return
    windows, segment = len(schedule.layout.windows), schedule.limit - 1
    here = schedule.advance(state.epoch, state.batch_index)
    if not schedule.advance(segment, 0) <= here <= schedule.advance(schedule.limit, 0):
        raise TrainError(
            f"{latest_checkpoint(paths['run_dir']) or paths['run_dir']}: the drafter's data position is segment "
            f"{here[0]} batch {here[1]} of the rolling schedule ({windows} windows per epoch); asked to train segment "
            f"{segment} (epoch × {windows} + window): that would train a window twice or skip one. The rolling "
            f"state and the checkpoints disagree; remove {paths['run_dir']} (with its rolling.json) to train anew"
        )
    report.log(f"rolling: segment {segment} (epoch × {windows} + window), {len(schedule.batches[segment])} batches")


def run_metadata(
    state: RunState, resumed_from: int | None, *, schedule: TrainingSchedule, times: LoopTimes, trainer: Trainer,
    inputs: Inputs, export_dir: Path,
) -> dict[str, Any]:  # fmt: skip
    """The phase's metadata on every rank (rank 0 adds the export's wall time and latest checkpoint)."""
    curve, trained = state.curve, times.trained_tokens
    next_epoch, _ = schedule.advance(state.epoch, state.batch_index)
    finished = state.step >= schedule.total_steps or next_epoch >= len(schedule.batches)
    return {
        "steps": state.step,
        "total_steps": schedule.total_steps,
        "resumed_from_step": resumed_from,
        "trained_tokens_this_run": trained,
        "processes": trainer.ranks.world,
        "train_loop_s": round(times.loop_s, 3),
        "checkpoint_s": round(times.checkpoint_s, 3),
        "tokens_per_s": round(trained / times.loop_s, 1) if trained else None,
        "first_loss": curve[0]["loss"] if curve else None,
        "last_loss": curve[-1]["loss"] if curve else None,
        "curve": curve,
        "evals": state.evals,
        "tau_curve": state.tau_curve,
        **({"start": state.start} if state.start is not None else {}),
        "export_dir": str(export_dir),
        "device": str(trainer.device),
        "autocast": str(trainer.autocast) if trainer.autocast else "float32",
        "drafter": inputs.config.to_dict(),
        "finished": finished,
    }


def vocab_sha256(d2t: torch.Tensor, t2d: torch.Tensor) -> str:
    digest = hashlib.sha256(d2t.to(torch.int64).numpy().tobytes())
    digest.update(t2d.to(torch.bool).numpy().tobytes())
    return digest.hexdigest()


def _processes(count: int) -> str:
    return f"{count} processes" if count > 1 else "1 process"
