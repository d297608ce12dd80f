"""Stand-in for ``sglang.srt.distributed.bootstrap`` (see the sglang package docstring): the
process groups, built once after publish and before any runner."""

from __future__ import annotations

from typing import Any

from sglang_standin_core.runner import init_distributed_environment

from sglang.srt.runtime_context import get_device, get_parallel

_STATE = {"parallel": False, "layers": False}


def init_parallel_runtime(*, server_args: Any, device: str, dist_port: int) -> None:
    """Once per process, after publish: the process groups of the published placement."""
    if _STATE["parallel"]:
        raise RuntimeError("init_parallel_runtime() ran twice in this process")
    parallel = get_parallel()
    if device != get_device().device:
        raise RuntimeError(f"init_parallel_runtime: device {device!r}, the published device is {get_device().device!r}")
    _init_parallel_groups(parallel.tp_size, parallel.tp_rank)
    _STATE["parallel"] = True


def _init_parallel_groups(world_size: int, rank: int) -> None:
    init_distributed_environment(world_size=world_size, rank=rank)


def init_layer_runtime(*, model_config: Any) -> None:
    if not _STATE["parallel"]:
        raise RuntimeError("init_layer_runtime: init_parallel_runtime first")
    _STATE["layers"] = True


def parallel_ready() -> bool:
    return _STATE["parallel"] and _STATE["layers"]
