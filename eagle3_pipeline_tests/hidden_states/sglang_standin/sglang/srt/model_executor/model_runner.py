"""Stand-in for ``sglang.srt.model_executor.model_runner`` (see the sglang package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

KV_POOL_TOKENS = 1 << 16


@dataclass
class ModelRunnerOutput:
    logits_output: Any
    can_run_graph: bool


def _model(model_config: Any) -> Any:
    from eagle3_pipeline.target import language_model, load_causal_lm
    from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration
    from sglang.srt.models.llama import LlamaForCausalLM

    classes = {
        "LlamaForCausalLM": LlamaForCausalLM,
        "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
        "KimiK25ForConditionalGeneration": KimiK25ForConditionalGeneration,
    }
    [architecture] = model_config.hf_config.architectures
    if architecture not in classes:
        raise ValueError(f"stand-in: no model class for {architecture} (it has {sorted(classes)})")
    dtype = "float32" if model_config.dtype == "auto" else model_config.dtype
    loaded = load_causal_lm(model_config.model_path, model_config.trust_remote_code, dtype, "cpu")
    return classes[architecture](language_model(loaded)).eval()


class ModelRunner:
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
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() != tp_size or dist.get_rank() != tp_rank:
            raise RuntimeError(
                f"stand-in ModelRunner: torch.distributed must be joined by {tp_size} ranks (this is rank {tp_rank})"
            )
        if not server_args.disable_radix_cache or server_args.chunked_prefill_size != -1:
            raise RuntimeError(
                "stand-in ModelRunner: the radix cache and chunked prefill split a prompt's rows; turn both off"
            )
        self.model_config = model_config
        self.server_args = server_args
        self.mem_fraction_static = mem_fraction_static
        self.gpu_id = gpu_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.model = _model(model_config)
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
