"""Where the training numbers move: the processes of a run (``torchrun`` ranks, DistributedDataParallel),
the device and precision, the optimizer and its schedule, and the RNG state a checkpoint keeps.

Several processes (``torchrun``, one per GPU; :func:`join_ranks` reads its environment): every optimizer
step is one scheduled batch whatever the number of processes, each rank reading a disjoint share of its
samples (:func:`rank_rows`), and the ranks' gradients are all-reduced, so N processes follow the
trajectory of one (up to floating-point summation order).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eagle3_pipeline.drafter.spec import TrainSettings
from eagle3_pipeline.drafter.train.data import Row

ADAM_BETAS = (0.9, 0.95)


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


ONE_PROCESS = Ranks()


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
    """This rank's share of a scheduled batch (every ``world``-th sample from ``rank``) and whether it
    is real. A rank left without a sample (a batch of fewer samples than ranks) reads the batch's
    first sample as a stand-in that counts for nothing, so every rank still joins the step."""
    mine = list(rows[ranks.rank :: ranks.world])
    return (mine, True) if mine else ([rows[0]], False)


def pick_device(dtype_setting: str, local_rank: int = 0) -> tuple[torch.device, torch.dtype | None]:
    """CUDA (GPU ``local_rank``) with bf16 autocast when present (``dtype: auto``); fp32 on the CPU."""
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if dtype_setting == "float32":
        return device, None
    if dtype_setting == "bfloat16" or (device.type == "cuda" and torch.cuda.is_bf16_supported()):
        return device, torch.bfloat16
    return device, None


def distributed(model: nn.Module, ranks: Ranks, device: torch.device) -> Callable[..., list[torch.Tensor]]:
    """The training forward: the model itself, or under several ranks its DistributedDataParallel
    wrapper (which all-reduces the gradients in the backward)."""
    if ranks.world == 1:
        return model
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[ranks.local_rank] if device.type == "cuda" else None, broadcast_buffers=False
    )


def lr_lambda(total_steps: int, warmup_steps: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


class Optimization:
    """AdamW over the trainable parameters with a linear warmup then cosine schedule, gradient clipping,
    and the backward of a rank's loss (DDP averages the ranks' gradients; their losses add up)."""

    def __init__(self, model: nn.Module, settings: TrainSettings, total_steps: int, ranks: Ranks) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=settings.lr, betas=ADAM_BETAS, weight_decay=settings.weight_decay
        )
        warmup = max(1, int(settings.warmup_ratio * total_steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(total_steps, warmup))
        self.grad_clip = settings.grad_clip
        self.world = ranks.world

    def step(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        (loss * self.world).backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
