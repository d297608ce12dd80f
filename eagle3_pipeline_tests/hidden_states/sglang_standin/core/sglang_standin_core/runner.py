"""What both releases' ``model_executor.model_runner.ModelRunner`` do alike once built: the pools,
the attention backends, the eager runner and the forward. A release's ``ModelRunner`` subclass
checks what its constructor needs (ranks, a published config, process groups) and loads the model
through :func:`runner_model`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_standin_core.pools import BaseTokenToKVPoolAllocator, ReqToTokenPool

KV_POOL_TOKENS = 1 << 16


@dataclass
class ModelRunnerOutput:
    logits_output: Any
    can_run_graph: bool


def runner_model(model_config: Any) -> Any:
    """The checkpoint as the active release's model class (the ``sglang`` tree on ``sys.path``)."""
    from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM  # pyright: ignore[reportMissingImports]
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration  # pyright: ignore[reportMissingImports]
    from sglang.srt.models.llama import LlamaForCausalLM  # pyright: ignore[reportMissingImports]

    from sglang_standin_core.models import load_model

    return load_model(
        model_config,
        {
            "LlamaForCausalLM": LlamaForCausalLM,
            "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
            "KimiK25ForConditionalGeneration": KimiK25ForConditionalGeneration,
        },
    )


def init_distributed_environment(world_size: int, rank: int) -> None:
    """SGLang's ``init_distributed_environment`` keeps a torch.distributed world it finds: the
    stand-in needs the launch's world, ``world_size`` ranks, this one ``rank``."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"stand-in init_distributed_environment: torch.distributed must be joined by {world_size} ranks "
            f"(this is rank {rank})"
        )


class RunnerBase:
    def __init__(self, model_config: Any, server_args: Any, mem_fraction_static: float, gpu_id: int) -> None:
        if not server_args.disable_radix_cache or server_args.chunked_prefill_size != -1:
            raise RuntimeError(
                "stand-in ModelRunner: the radix cache and chunked prefill split a prompt's rows; turn both off"
            )
        self.model_config = model_config
        self.server_args = server_args
        self.mem_fraction_static = mem_fraction_static
        self.gpu_id = gpu_id
        self.model = runner_model(model_config)
        self.req_to_token_pool: Any = None
        self.token_to_kv_pool_allocator: Any = None
        self.attention_ready = False
        self.eager_runner_ready = False

    def alloc_memory_pool(self) -> None:
        self.max_total_num_tokens = KV_POOL_TOKENS
        self.max_running_requests = self.server_args.max_running_requests or 256
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests)
        self.token_to_kv_pool_allocator = BaseTokenToKVPoolAllocator(self.max_total_num_tokens)

    def init_attention_backends(self) -> None:
        if self.req_to_token_pool is None:
            raise RuntimeError("stand-in ModelRunner: alloc_memory_pool first")
        self.attention_ready = True

    def init_cuda_graphs(self) -> None:
        if not self.server_args.disable_cuda_graph:
            raise RuntimeError("stand-in ModelRunner: no CUDA graphs on the CPU; set disable_cuda_graph")
        if not self.attention_ready:
            raise RuntimeError("stand-in ModelRunner: init_attention_backends first")
        self.eager_runner_ready = True

    def forward(self, forward_batch: Any) -> ModelRunnerOutput:
        import torch

        if not self.eager_runner_ready:
            raise RuntimeError("stand-in ModelRunner: init_cuda_graphs builds the eager runner the forward needs")
        with torch.no_grad():
            out = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
        return ModelRunnerOutput(logits_output=out, can_run_graph=False)
