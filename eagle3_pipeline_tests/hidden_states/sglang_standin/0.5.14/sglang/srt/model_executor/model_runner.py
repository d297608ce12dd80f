"""Stand-in for ``sglang.srt.model_executor.model_runner`` (see the sglang package docstring)."""

from __future__ import annotations

from typing import Any

from sglang_standin_core.runner import ModelRunnerOutput, RunnerBase, init_distributed_environment

__all__ = ["ModelRunner", "ModelRunnerOutput"]


class ModelRunner(RunnerBase):
    """0.5.14: the launcher hands the runner its ranks; the runner joins the process groups itself
    (SGLang keeps a world it finds) and reads the resolved settings off ``server_args``."""

    def __init__(
        self,
        model_config: Any,
        mem_fraction_static: float,
        gpu_id: int,
        tp_rank: int,
        tp_size: int,
        moe_ep_rank: int,
        moe_ep_size: int,
        pp_rank: int,
        pp_size: int,
        nccl_port: int,
        server_args: Any,
        is_draft_worker: bool = False,
    ) -> None:
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.init_torch_distributed()
        if pp_size != 1 or pp_rank != 0 or moe_ep_size != server_args.ep_size:
            raise RuntimeError("stand-in ModelRunner: one pipeline stage, the expert-parallel size of server_args")
        super().__init__(model_config, server_args, mem_fraction_static, gpu_id)
        self.device = server_args.device

    def init_torch_distributed(self) -> None:
        init_distributed_environment(world_size=self.tp_size, rank=self.tp_rank)
