"""Stand-in for ``sglang.srt.runtime_context`` (see the sglang package docstring): the process's
published configuration and placement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.arg_groups.fields.device import Device
from sglang.srt.arg_groups.fields.schedule import Schedule


@dataclass(frozen=True)
class SpawnRanks:
    world_rank: int
    dp_rank: int | None = None
    gpu_id: int | None = None


@dataclass
class Parallel:
    tp_size: int
    tp_rank: int


_PUBLISHED: dict[str, Any] = {}


def publish(server_args: Any, *, role: str, hf_config: Any = None, ranks: SpawnRanks | None = None) -> None:
    """Resolve ``server_args`` and install it, with this process's placement, for ``role``."""
    resolved = server_args.resolve_once()
    _PUBLISHED.clear()
    _PUBLISHED.update(
        server_args=server_args,
        role=role,
        schedule=Schedule(page_size=int(resolved["page_size"])),
        device=Device(device=str(resolved["device"]), gpu_id=ranks.gpu_id if ranks is not None else None),
        parallel=Parallel(tp_size=server_args.tp_size, tp_rank=ranks.world_rank if ranks is not None else 0),
    )


def _bag(name: str) -> Any:
    if name not in _PUBLISHED:
        raise ValueError(f"config namespace {name!r} is not published (runtime_context.publish)")
    return _PUBLISHED[name]


def get_schedule() -> Schedule:
    return _bag("schedule")


def get_device() -> Device:
    return _bag("device")


def get_parallel() -> Parallel:
    return _bag("parallel")


def assert_published(server_args: Any, *, role: str) -> None:
    if _PUBLISHED.get("server_args") is not server_args or _PUBLISHED.get("role") != role:
        raise RuntimeError(
            f"config not published for role {role!r}: the process entry publishes -- add "
            "publish(server_args, role=...) there"
        )
