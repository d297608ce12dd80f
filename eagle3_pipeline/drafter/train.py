"""Train the EAGLE-3 drafter on the hidden-state store: the ``train`` heavy phase (``run(spec, report)``).

Spec (paths on the machine where the phase runs)::

    store            the hidden-state store folder (C3)
    draft_vocab      the draft vocabulary folder (C4)
    target_weights   the target model folder (config.json + safetensors: embedding, lm_head)
    run_dir          checkpoints and the metric curve of this drafter
    export_dir       the served directory written at the end (export.export_for_servers)
    settings         :class:`TrainSettings` fields (``model``: the ``drafter.model`` overrides of
                     the draft shape and RoPE)

Loss (SpecForge's ``OnlineEagle3Model``): at TTT step j and index t the drafter predicts token t+2+j; the teacher is the
target's distribution at index t+1+j renormalised over the draft vocabulary; positions count when
the predicted token is a trained (loss-masked) token and the target's argmax is in the draft
vocabulary. Step losses are averaged over counted positions and weighted 0.8**j. Accuracy of step j
is the share of loss-masked positions whose mapped draft argmax equals the target's argmax.

Several processes (``torchrun``, one per GPU; :func:`join_ranks` reads its environment): every
optimizer step is one planned batch whatever the number of processes, each rank reading a disjoint
share of its samples (:func:`rank_rows`); step losses are normalised by the counted positions of
the whole batch and DistributedDataParallel all-reduces the gradients, so N processes follow the
trajectory of one (up to floating-point summation order). The data position in a checkpoint is a
batch of the plan, so a run may resume under another number of processes. Only rank 0 evaluates,
writes checkpoints and the export, and reports. Metrics stay on the device and are synced (and
all-reduced) once every ``log_every`` steps.

Each checkpoint also records τ per eval dataset against the training tokens seen so far, in total
and per dataset (``tau_curve``, :mod:`eagle3_pipeline.drafter.scaling`): in the checkpoint, so it
survives a resume, in ``<run_dir>/tau_curve.json`` and in the phase's metadata.

A kill at any point loses at most ``checkpoint_every`` steps: the next run continues from the last
complete checkpoint, with the same data order, optimizer, scheduler and RNG state. It refuses to
continue when the draft vocabulary, the store or the training settings differ from the
checkpoint's, and says so; it never rebuilds the vocabulary mapping itself.

Rolling mode (spec ``rolling: {epoch, window}``, driven by :mod:`eagle3_pipeline.drafter.rolling`):
the store holds its eval shards and one window of train shards. The data plan is then a sequence of
segments, one per (epoch, window) in that order, each the window's rows shuffled by seed, epoch and
window (:func:`rolling_plans`, from the store's rolling layout, so the total steps and the learning
rate schedule are those of the whole run); a checkpoint's ``epoch`` is the segment. A run trains one
segment from the checkpoint's position to its end, checkpoints there and exports only after the
last; it refuses a checkpoint that is not within that segment (a window trained twice, or one
skipped), and the rolling layout is part of the checkpoint identity, so a normal run's checkpoint is
never continued as a rolling one, nor the other way round.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.drafter.acceptance import ALL, AcceptanceStats, with_total
from eagle3_pipeline.drafter.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from eagle3_pipeline.drafter.data import Batch, BatchReader, Row, epoch_plan, store_rows, teacher
from eagle3_pipeline.drafter.evaluate import add_drafter_batch, read_rows
from eagle3_pipeline.drafter.export import export_for_servers
from eagle3_pipeline.drafter.model import (
    DrafterConfig,
    Eagle3Drafter,
    rope_kind,
    soft_label_cross_entropy,
    target_rope,
    yarn_for_servers,
)
from eagle3_pipeline.drafter.scaling import curve_point, new_curve, tokens_seen, write_curve
from eagle3_pipeline.drafter.target import TargetWeights, load_target_weights
from eagle3_pipeline.hidden_states.plan import RollingLayout, read_rolling_layout
from eagle3_pipeline.hidden_states.store import MASK_KEY, HiddenStateStore, load_draft_vocab
from eagle3_pipeline.target import is_mla

STEP_DECAY = 0.8
# Draft depths K whose τ each checkpoint records (those ≤ ttt_steps, and ttt_steps). The τ curve per
# eval dataset (drafter/scaling.py) takes the smallest: drafter_eval's smallest default K and
# drafter_benchmark's default steps, so the curve compares with both; and at K = 3 a verify step's
# tokens vary least (1..4), so the few eval rows a checkpoint reads give the steadiest curve.
EVAL_DEPTHS = (3, 5, 7)
ADAM_BETAS = (0.9, 0.95)
CURVE_FILE = "curve.jsonl"
MODEL_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rope_theta", "rope_scaling", "max_position_embeddings",
)  # fmt: skip
# The draft attention for an MLA target (see mla_draft_shape): the published DeepSeek-V3 drafter's.
MLA_DRAFT_HEAD_DIM = 128
MLA_DRAFT_KV_HEADS = 8
MLA_DRAFT_INTERMEDIATE, MLA_DRAFT_HIDDEN = 40960, 7168  # intermediate at hidden 7168, scaled with the hidden size


class TrainError(ValueError):
    """A training run that cannot start or continue; the message says why and what to do."""


@dataclass(frozen=True)
class TrainSettings:
    ttt_steps: int = 7
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.02
    epochs: int = 1
    max_steps: int | None = None
    batch_tokens: int = 16384
    max_seq_len: int = 2048
    grad_clip: float = 0.5
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    eval_samples: int = 256
    log_every: int = 10
    seed: int = 0
    dtype: str = "auto"
    export_dtype: str = "bfloat16"
    embedding_key: str | None = None
    lm_head_key: str | None = None
    activation_checkpointing: bool = False
    model: dict[str, Any] = field(default_factory=dict)  # drafter.model overrides (DrafterModelConfig)

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint (bookkeeping settings excluded, and
        activation checkpointing: it recomputes the same values, so a run may resume with it switched)."""
        skip = {
            "checkpoint_every",
            "keep_checkpoints",
            "eval_samples",
            "log_every",
            "export_dtype",
            "activation_checkpointing",
        }
        return {k: v for k, v in asdict(self).items() if k not in skip}


def mla_draft_shape(hidden: int, overrides: Mapping[str, Any]) -> dict[str, int]:
    """Draft attention and MLP for an MLA target, whose own attention shape (64 query heads over a
    compressed latent KV, head_dim 112 when read as hidden/heads) is no model for a Llama layer.

    Defaults follow the published DeepSeek-V3 drafter, SpecForge ``configs/deepseek-v3-671b-eagle3.json``
    (sgl-project/SpecForge @ c02a09a): Llama GQA with head_dim 128, 56 heads (hidden 7168 / 128), 8 KV
    heads, intermediate 40960 (scaled here as 40960/7168 of the draft hidden size, rounded up to a
    multiple of 128), draft vocabulary 32000 (``draft_vocab.size``). Others published differ:
    SpecForge's ``kimi-k2-eagle3.json``/``kimi-k25-eagle3.json`` use 64 heads × 64 KV heads × 128,
    intermediate 18432, no RoPE scaling; TorchSpec's ``kimi_k25_eagle3.json`` 64 × 64 × 128,
    intermediate 12288, the full 163840 vocabulary. The 8 KV heads keep the draft KV cache at 1/8 of
    theirs. Fewer heads than 8 (a small hidden size) get the largest KV-head count dividing them.
    """
    head_dim = int(overrides.get("head_dim") or MLA_DRAFT_HEAD_DIM)
    heads = int(overrides.get("num_attention_heads") or max(1, hidden // head_dim))
    kv_heads = overrides.get("num_key_value_heads") or max(
        n for n in range(1, min(heads, MLA_DRAFT_KV_HEADS) + 1) if heads % n == 0
    )
    intermediate = overrides.get("intermediate_size") or 128 * -(
        -hidden * MLA_DRAFT_INTERMEDIATE // (MLA_DRAFT_HIDDEN * 128)
    )
    return {
        "head_dim": head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "intermediate_size": int(intermediate),
    }


def copied_draft_shape(target: Mapping[str, Any], hidden: int, overrides: Mapping[str, Any]) -> dict[str, int]:
    """Draft attention and MLP copied from a (GQA/MHA) target; a resized hidden divides among the heads."""
    heads = int(overrides.get("num_attention_heads") or target["num_attention_heads"])
    default_head_dim = target.get("head_dim") or int(target["hidden_size"]) // int(target["num_attention_heads"])
    return {
        "head_dim": int(
            overrides.get("head_dim") or (default_head_dim if hidden == int(target["hidden_size"]) else hidden // heads)
        ),
        "num_attention_heads": heads,
        "num_key_value_heads": int(overrides.get("num_key_value_heads") or target.get("num_key_value_heads", heads)),
        "intermediate_size": int(overrides.get("intermediate_size") or target["intermediate_size"]),
    }


def drafter_rope(target: Mapping[str, Any], overrides: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, int]:
    """``(rope_theta, rope_scaling, max_position_embeddings)``: the target's, or ``drafter.model``'s
    (``rope_scaling: null`` there means no scaling). A YaRN scaling is rewritten by
    :func:`~eagle3_pipeline.drafter.model.yarn_for_servers` so every server reads it as trained. The
    drafter serves at least the target's context: a smaller ``max_position_embeddings`` is refused."""
    theta, scaling = target_rope(dict(target))
    where = "target config rope_scaling"
    if overrides.get("rope_theta") is not None:
        theta = float(overrides["rope_theta"])
    if "rope_scaling" in overrides:
        scaling, where = overrides["rope_scaling"], "drafter.model.rope_scaling"
    if rope_kind(scaling) == "default":
        scaling = None
    elif rope_kind(scaling) == "yarn":
        scaling = yarn_for_servers(dict(scaling or {}), where)
    target_positions = int(target.get("max_position_embeddings", 4096))
    positions = int(overrides.get("max_position_embeddings") or target_positions)
    if positions < target_positions:
        raise TrainError(
            f"drafter.model.max_position_embeddings {positions}: expected at least the target's {target_positions} "
            "(the server drafts at every position the target serves)"
        )
    return theta, scaling, positions


def drafter_config(
    target: Mapping[str, Any], draft_vocab_size: int, aux_layer_ids: list[int], overrides: Mapping[str, Any]
) -> DrafterConfig:
    """The draft model for ``target``, the language model's config as a flat dict (a nested
    ``text_config`` resolved). Hidden size, vocabulary, norm epsilon, RoPE and context are the
    target's; attention and MLP are the target's too (:func:`copied_draft_shape`) except for an MLA
    target (:func:`mla_draft_shape`). Every default yields to ``drafter.model.*`` (``overrides``; a key
    given as None counts as left out, except ``rope_scaling``)."""
    unknown = sorted(set(overrides) - set(MODEL_KEYS))
    if unknown:
        raise TrainError(f"drafter.model: unknown keys {unknown}; expected a subset of {list(MODEL_KEYS)}")
    hidden = int(overrides.get("hidden_size") or target["hidden_size"])
    shape = mla_draft_shape(hidden, overrides) if is_mla(target) else copied_draft_shape(target, hidden, overrides)
    theta, scaling, positions = drafter_rope(target, overrides)
    return DrafterConfig(
        hidden_size=hidden,
        target_hidden_size=int(target["hidden_size"]),
        intermediate_size=shape["intermediate_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        vocab_size=int(target["vocab_size"]),
        draft_vocab_size=draft_vocab_size,
        rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=positions,
        aux_layer_ids=list(aux_layer_ids),
    )


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


@dataclass(frozen=True)
class Ranks:
    """The processes of one training run: this one (``rank``) of ``world`` (1 without torchrun)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (nothing to do for one process)."""
        if self.world > 1:
            torch.distributed.all_reduce(tensor)
        return tensor


def join_ranks() -> Ranks:
    """This process's place in a ``torchrun`` launch (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``),
    joining the process group: NCCL on CUDA (GPU ``LOCAL_RANK``), gloo on the CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return Ranks(rank, world, local_rank)


def rank_rows(rows: Sequence[Row], ranks: Ranks) -> tuple[list[Row], bool]:
    """This rank's share of a planned batch (every ``world``-th sample from ``rank``) and whether it
    is real. A rank left without a sample (a batch of fewer samples than ranks) reads the batch's
    first sample as a stand-in that counts for nothing, so every rank still joins the step."""
    mine = list(rows[ranks.rank :: ranks.world])
    return (mine, True) if mine else ([rows[0]], False)


@dataclass
class StepMetrics:
    """One batch on one rank, all on the device: ``loss`` the weighted total and ``step_losses``
    [steps] (this rank's share of the batch's loss when several ranks), ``hits`` [steps] the
    loss-masked positions whose mapped draft argmax is the target's argmax, ``trained`` [steps]
    the loss-masked positions."""

    loss: torch.Tensor
    step_losses: torch.Tensor
    hits: torch.Tensor
    trained: torch.Tensor


def ttt_loss(
    model: Eagle3Drafter,
    batch: Batch,
    lm_head: torch.Tensor,
    steps: int,
    ranks: Ranks = Ranks(),
    forward: Callable[..., list[torch.Tensor]] | None = None,
    activation_checkpointing: bool = False,
) -> StepMetrics:
    """Unrolled TTT forward (through ``forward``, the DDP wrapper, when given; its decoder layer
    recomputed in the backward with ``activation_checkpointing``), soft-label loss against the target
    over the draft vocabulary, in chunks of counted positions (``soft_label_cross_entropy``: no
    float32 log-probabilities or label copies beside the logits). Each step's loss is divided by the
    counted positions of the whole batch (summed over ``ranks``), so the ranks' losses add up to it."""
    # The prediction at index p is trained when token p + 1 is (loss mask); only those need the teacher.
    target = teacher(batch.hidden, lm_head, model.t2d, F.pad(batch.loss_mask[:, 1:], (0, 1)))
    argmaxes = [F.pad(target.argmax[:, j + 1 :], (0, j + 1)) for j in range(steps)]
    trained = [F.pad(batch.loss_mask[:, j + 2 :], (0, j + 2)).float() for j in range(steps)]
    counted = [t * model.t2d[a].float() for t, a in zip(trained, argmaxes, strict=True)]
    counts = ranks.all_reduce(torch.stack([c.sum() for c in counted])).clamp(min=1.0)
    # Only counted indices reach the loss, and only they can hit (elsewhere the target's argmax is not
    # in the draft vocabulary, or the index is not trained): the draft head runs on them alone.
    keep = [c.bool() for c in counted]
    logits = (forward or model)(batch.aux, batch.input_ids, steps, batch.attention_mask, keep, activation_checkpointing)
    probs = target.probs.flatten(0, 1)
    total = torch.zeros((), device=batch.aux.device)
    step_losses: list[torch.Tensor] = []
    hits: list[torch.Tensor] = []
    for j, step_logits in enumerate(logits):
        # Step j's teacher at index t is the target's distribution at t + 1 + j (< T where counted).
        rows = keep[j].flatten().nonzero().squeeze(1) + (j + 1)
        loss = soft_label_cross_entropy(step_logits, probs, rows) / counts[j]
        total = total + (STEP_DECAY**j) * loss
        step_losses.append(loss.detach())
        with torch.no_grad():
            hits.append((model.draft_target_ids(step_logits) == argmaxes[j][keep[j]]).float().sum())
    return StepMetrics(total, torch.stack(step_losses), torch.stack(hits), torch.stack([t.sum() for t in trained]))


def lr_lambda(total_steps: int, warmup_steps: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def pick_device(dtype_setting: str, local_rank: int = 0) -> tuple[torch.device, torch.dtype | None]:
    """CUDA (GPU ``local_rank``) with bf16 autocast when present (``dtype: auto``); fp32 on the CPU."""
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if dtype_setting == "float32":
        return device, None
    if dtype_setting == "bfloat16" or (device.type == "cuda" and torch.cuda.is_bf16_supported()):
        return device, torch.bfloat16
    return device, None


def vocab_sha256(d2t: torch.Tensor, t2d: torch.Tensor) -> str:
    digest = hashlib.sha256(d2t.to(torch.int64).numpy().tobytes())
    digest.update(t2d.to(torch.bool).numpy().tobytes())
    return digest.hexdigest()


def eval_depths(ttt_steps: int) -> list[int]:
    return sorted({k for k in EVAL_DEPTHS if k <= ttt_steps} | {ttt_steps})


def row_tokens(store: HiddenStateStore, max_seq_len: int) -> dict[Row, tuple[str, int]]:
    """Each index row's dataset and loss-masked tokens within ``max_seq_len`` (what training reads of
    it): the index's count, or for a longer row its mask read up to ``max_seq_len``."""
    out: dict[Row, tuple[str, int]] = {}
    longer = []
    for r in store.index().to_pylist():
        if r["length"] > max_seq_len:
            longer.append(r)
        else:
            out[Row(r["shard"], r["offset"], r["length"])] = (r["dataset"], int(r["num_masked"]))
    for r, tensors in read_rows(store, longer, (MASK_KEY,)):
        out[Row(r["shard"], r["offset"], r["length"])] = (r["dataset"], int(tensors[MASK_KEY][:max_seq_len].sum()))
    return out


def eval_plans(
    rows: Sequence[Row], tokens_of: Mapping[Row, tuple[str, int]], settings: TrainSettings
) -> dict[str, list[list[Row]]]:
    """The batches each checkpoint evaluates, per dataset: at most ``eval_samples`` rows in all, taken
    from the datasets in turn (index order within each), so every eval dataset gets a τ."""
    by_dataset: dict[str, list[Row]] = {}
    for row in rows:
        by_dataset.setdefault(tokens_of[row][0], []).append(row)
    queues = [by_dataset[d] for d in sorted(by_dataset)]
    chosen = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)][
        : settings.eval_samples
    ]
    plans = {
        d: epoch_plan(
            [r for r in chosen if tokens_of[r][0] == d], settings.seed, -1, settings.batch_tokens, settings.max_seq_len
        )
        for d in sorted(by_dataset)
    }
    return {d: plan for d, plan in plans.items() if plan}


@torch.no_grad()
def evaluate(
    model: Eagle3Drafter,
    reader: BatchReader,
    plans: Mapping[str, list[list[Row]]],
    lm_head: torch.Tensor,
    settings: TrainSettings,
    device: torch.device,
    autocast: torch.dtype | None,
) -> tuple[dict[str, float], dict[str, AcceptanceStats]]:
    """Per-step loss and accuracy on the eval split, weighted by tokens, and the acceptance length τ
    a greedy chain-drafting server would see (``tau@K``): accuracy can look fine while τ collapses.
    Also the acceptance per eval dataset (``plans``' keys) and ``all``, for the τ curve."""
    model.eval()
    depths = eval_depths(settings.ttt_steps)
    per_dataset = {dataset: AcceptanceStats(ks=tuple(depths)) for dataset in plans}
    losses = torch.zeros(settings.ttt_steps, device=device)
    hits = torch.zeros(settings.ttt_steps, device=device)
    trained = torch.zeros(settings.ttt_steps, device=device)
    weight = 0
    for dataset, plan in plans.items():
        for _, batch in reader.batches(plan):
            tokens = int(batch.loss_mask.sum())
            batch = batch.to(device)
            with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
                metrics = ttt_loss(model, batch, lm_head, settings.ttt_steps)
                add_drafter_batch(
                    per_dataset[dataset], model, batch.aux, batch.input_ids, batch.loss_mask, batch.attention_mask
                )
            weight += tokens
            losses += metrics.step_losses * tokens
            hits += metrics.hits
            trained += metrics.trained
    model.train()
    if not weight:
        return {}, {}
    acceptance = with_total(per_dataset, depths)
    loss_values = (losses / weight).tolist()
    acc_values = (hits / trained.clamp(min=1.0)).tolist()
    return {
        **{f"eval_loss_{j}": loss_values[j] for j in range(settings.ttt_steps)},
        **{f"eval_acc_{j}": acc_values[j] for j in range(settings.ttt_steps)},
        **{f"tau@{k}": acceptance[ALL].tau(k) for k in depths},
    }, acceptance


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def parse_spec(spec: Mapping[str, Any]) -> tuple[dict[str, Path], TrainSettings]:
    missing = [k for k in ("store", "draft_vocab", "target_weights", "run_dir", "export_dir") if not spec.get(k)]
    if missing:
        raise TrainError(f"train spec: missing {', '.join(missing)}")
    raw = dict(spec.get("settings") or {})
    known = set(TrainSettings.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise TrainError(f"train spec: settings has unknown keys {unknown}")
    paths = {k: Path(spec[k]) for k in ("store", "draft_vocab", "target_weights", "run_dir", "export_dir")}
    return paths, TrainSettings(**raw)


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


def rolling_plans(
    layout: RollingLayout, settings: TrainSettings
) -> tuple[list[list[list[Row]]], dict[Row, tuple[str, int]]]:
    """The segments of a rolling run, one per (epoch, window), epoch-major, each the window's rows
    (of 3 tokens or more) planned by :func:`epoch_plan` keyed ``epoch/window``; and each train row's
    dataset and loss-masked tokens from the layout (the whole row's, also for a row longer than
    ``max_seq_len``: the τ curve's token counts then include its cut tail)."""
    tokens_of = {Row(r.shard, r.offset, r.length): (r.dataset, r.num_masked) for r in layout.rows}
    rows = [
        [Row(r.shard, r.offset, r.length) for r in layout.window_rows(w) if r.length >= 3]
        for w in range(len(layout.windows))
    ]
    plans = [
        epoch_plan(rows[w], settings.seed, f"{e}/{w}", settings.batch_tokens, settings.max_seq_len)
        for e in range(settings.epochs)
        for w in range(len(rows))
    ]
    return plans, tokens_of


def _segment(rolling: Any, windows: int) -> int:
    """The segment a rolling spec asks for (``{epoch, window}``), checked against the layout."""
    try:
        epoch, window = int(rolling["epoch"]), int(rolling["window"])
    except (TypeError, KeyError, ValueError):
        raise TrainError(f"train spec: rolling: expected {{epoch: int, window: int}}, got {rolling!r}") from None
    if not 0 <= window < windows or epoch < 0:
        raise TrainError(f"train spec: rolling: window {window} of epoch {epoch}; the layout has {windows} windows")
    return epoch * windows + window


def _advance(plans: Sequence[Sequence[Any]], epoch: int, batch_index: int) -> tuple[int, int]:
    """The data position ``(epoch, batch_index)`` moved past the ends of plans (a normal form)."""
    while epoch < len(plans) and batch_index >= len(plans[epoch]):
        epoch, batch_index = epoch + 1, 0
    return epoch, batch_index


def _processes(count: int) -> str:
    return f"{count} processes" if count > 1 else "1 process"


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


def _train(spec: dict[str, Any], report: Reporter, ranks: Ranks, started: float) -> dict[str, Any]:
    paths, settings = parse_spec(spec)
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
    config = drafter_config(target.config, int(d2t.shape[0]), list(manifest.aux_layer_ids), settings.model)
    rolling = spec.get("rolling")
    layout = read_rolling_layout(paths["store"]) if rolling is not None else None
    identity = {
        "settings": settings.identity(),
        "drafter": config.to_dict(),
        "store": manifest.identity(),
        "draft_vocab_sha256": vocab_sha256(d2t, t2d),
        "rolling": None if layout is None else layout.identity(),
    }
    device, autocast = pick_device(settings.dtype, ranks.local_rank)
    model = build_model(config, target, d2t, t2d, settings.seed).to(device)
    lm_head = target.lm_head.to(device, autocast or torch.float32)
    target_config = target.config
    del target

    tokens_of = row_tokens(store, settings.max_seq_len)
    if layout is None:
        train_rows = store_rows(store, "train")
        plans = [
            epoch_plan(train_rows, settings.seed, e, settings.batch_tokens, settings.max_seq_len)
            for e in range(settings.epochs)
        ]
        limit = settings.epochs
    else:
        plans, layout_tokens = rolling_plans(layout, settings)
        tokens_of.update(layout_tokens)
        train_rows = [row for plan in plans[: len(layout.windows)] for batch in plan for row in batch]
        limit = _segment(rolling, len(layout.windows)) + 1
    if not train_rows:
        raise TrainError(f"{paths['store']}: no train samples of 3 tokens or more")
    total_steps = sum(len(p) for p in plans)
    if settings.max_steps is not None:
        total_steps = min(total_steps, settings.max_steps)
    eval_by_dataset = eval_plans(store_rows(store, "eval"), tokens_of, settings)
    data_tokens: dict[str, int] = {}
    for row in train_rows:
        data_tokens[tokens_of[row][0]] = data_tokens.get(tokens_of[row][0], 0) + tokens_of[row][1]
    tau_k = eval_depths(settings.ttt_steps)[0]
    tau_curve = new_curve(tau_k, settings.epochs, data_tokens)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=ADAM_BETAS, weight_decay=settings.weight_decay)
    warmup = max(1, int(settings.warmup_ratio * total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, warmup))
    step, epoch, batch_index = 0, 0, 0
    curve: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    resumed_from: int | None = None
    processes = _processes(ranks.world)

    found = latest_checkpoint(paths["run_dir"])
    if found is not None:
        state, ck_d2t, ck_t2d = load_checkpoint(found)
        if not (torch.equal(ck_d2t, d2t) and torch.equal(ck_t2d, t2d)):
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
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        step, epoch, batch_index = state["step"], state["epoch"], state["batch_index"]
        curve, evals = state["curve"], state["evals"]
        tau_curve = state.get("tau_curve", tau_curve)  # a run checkpointed before the τ curve existed starts one here
        resumed_from = step
        written_by = state.get("world_size", 1)
        report.log(
            f"resuming from {found.name}: step {step}/{total_steps}, epoch {epoch}, batch {batch_index}, {processes}"
            + (
                f" (the checkpoint was written by a run of {_processes(written_by)})"
                if written_by != ranks.world
                else ""
            )
        )
    else:
        report.log(
            f"training a new drafter: {total_steps} steps over {len(train_rows)} samples, {settings.epochs} "
            f"epoch(s), device {device}, {processes}"
        )
    if layout is not None and step < total_steps:
        here, start, end = _advance(plans, epoch, batch_index), _advance(plans, limit - 1, 0), _advance(plans, limit, 0)
        if not start <= here <= end:
            raise TrainError(
                f"{found or paths['run_dir']}: the drafter's data position is segment {here[0]} batch {here[1]} of the "
                f"rolling plan ({len(layout.windows)} windows per epoch); asked to train segment {limit - 1} (epoch × "
                f"{len(layout.windows)} + window): that would train a window twice or skip one. The rolling state and "
                f"the checkpoints disagree; remove {paths['run_dir']} (with its rolling.json) to train anew"
            )
        report.log(
            f"rolling: segment {limit - 1} (epoch × {len(layout.windows)} + window), {len(plans[limit - 1])} batches"
        )

    forward: Callable[..., list[torch.Tensor]] = model
    if ranks.world > 1:
        forward = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[ranks.local_rank] if device.type == "cuda" else None, broadcast_buffers=False
        )

    def checkpoint() -> None:
        metrics, acceptance = evaluate(
            model,
            BatchReader(paths["store"], settings.max_seq_len),
            eval_by_dataset,
            lm_head,
            settings,
            device,
            autocast,
        )
        evals.append({"step": step, **metrics})
        if acceptance:
            tau_curve["points"].append(
                curve_point(step, tokens_seen(plans, epoch, batch_index, tokens_of), acceptance, tau_k)
            )
        write_curve(
            paths["run_dir"], tau_curve
        )  # before the checkpoint: never behind it (a resume recomputes the point)
        state = {
            "model": {
                k: v
                for k, v in model.state_dict().items()
                if not (k == "embed_tokens.weight" and model.embedding_frozen)
            },
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": _rng_state(),
            "step": step,
            "epoch": epoch,
            "batch_index": batch_index,
            "world_size": ranks.world,
            "curve": curve,
            "evals": evals,
            "tau_curve": tau_curve,
            "identity": identity,
        }
        where = save_checkpoint(paths["run_dir"], step, state, d2t, t2d, settings.keep_checkpoints)
        report.log(
            f"checkpoint {where.name} written; eval {json.dumps({k: round(v, 4) for k, v in evals[-1].items()})}"
        )

    reader = BatchReader(paths["store"], settings.max_seq_len)
    window = Window(settings.ttt_steps, device)
    trained_tokens = 0
    loop_started = time.monotonic()
    checkpoint_s = 0.0
    model.train()
    while step < total_steps and epoch < limit:
        if batch_index >= len(plans[epoch]):
            epoch, batch_index = epoch + 1, 0
            continue
        rows, real = rank_rows(plans[epoch][batch_index], ranks)
        batch = reader.read(rows)
        if not real:
            batch.loss_mask.zero_()
        tokens = batch.tokens if real else 0
        batch = batch.to(device)
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            metrics = ttt_loss(
                model, batch, lm_head, settings.ttt_steps, ranks, forward, settings.activation_checkpointing
            )
        optimizer.zero_grad(set_to_none=True)
        (metrics.loss * ranks.world).backward()  # DDP averages the ranks' gradients; their losses add up
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        batch_index += 1
        metrics.loss = metrics.loss.detach()
        window.add(metrics, tokens)
        if step % settings.log_every == 0 or step == total_steps:
            row, window_tokens = window.row(step, float(scheduler.get_last_lr()[0]), ranks)
            trained_tokens += window_tokens
            curve.append(row)
            report.progress({**row, "total_steps": total_steps, "epoch": epoch})
            window = Window(settings.ttt_steps, device)
        segment_end = layout is not None and batch_index == len(plans[epoch])
        if ranks.leader and (step % settings.checkpoint_every == 0 or step == total_steps or segment_end):
            checkpoint_started = time.monotonic()
            checkpoint()
            checkpoint_s += time.monotonic() - checkpoint_started
    loop_s = time.monotonic() - loop_started - checkpoint_s
    result = {
        "steps": step,
        "total_steps": total_steps,
        "resumed_from_step": resumed_from,
        "trained_tokens_this_run": trained_tokens,
        "processes": ranks.world,
        "train_loop_s": round(loop_s, 3),
        "checkpoint_s": round(checkpoint_s, 3),
        "tokens_per_s": round(trained_tokens / loop_s, 1) if trained_tokens else None,
        "first_loss": curve[0]["loss"] if curve else None,
        "last_loss": curve[-1]["loss"] if curve else None,
        "curve": curve,
        "evals": evals,
        "tau_curve": tau_curve,
        "export_dir": str(paths["export_dir"]),
        "device": str(device),
        "autocast": str(autocast) if autocast else "float32",
        "drafter": config.to_dict(),
    }
    result["finished"] = step >= total_steps or _advance(plans, epoch, batch_index)[0] >= len(plans)
    if not ranks.leader:
        return result
    if result["finished"]:
        model_cpu = model.to("cpu")
        export_for_servers(model_cpu, paths["export_dir"], target_config, dtype=settings.export_dtype)
        report.log(f"exported the drafter to {paths['export_dir']} after {time.monotonic() - started:.1f} s")
    wall = time.monotonic() - started
    return {**result, "wall_s": round(wall, 2), "checkpoint": str(latest_checkpoint(paths["run_dir"]))}
