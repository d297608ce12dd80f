"""Stand-in for ``sglang.srt.model_executor.model_runner`` (see the sglang package docstring)."""

from __future__ import annotations

from typing import Any

from sglang_standin_core.runner import ModelRunnerOutput, RunnerBase

from sglang.srt.distributed.bootstrap import parallel_ready
from sglang.srt.runtime_context import assert_published, get_device

__all__ = ["ModelRunner", "ModelRunnerOutput"]


class ModelRunner(RunnerBase):
    """0.5.23: no ranks (the published placement has them); the process entry published the
    ``ServerArgs`` and built the process groups before."""

    def __init__(
        self,
        model_config: Any,
        mem_fraction_static: float,
        gpu_id: int,
        nccl_port: int,
        server_args: Any,
        is_draft_worker: bool = False,
    ) -> None:
        if not is_draft_worker:
            assert_published(server_args, role="scheduler")
        if not parallel_ready():
            raise RuntimeError(
                "stand-in ModelRunner: the process groups are not built (distributed.bootstrap.init_parallel_runtime "
                "and init_layer_runtime run before the runner)"
            )
        super().__init__(model_config, server_args, mem_fraction_static, gpu_id)
        self.device = get_device().device
