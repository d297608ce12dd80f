"""GPU memory of a serving engine on one GPU: weights, the KV cache per token, the engine's budget rule,
and so the KV tokens it will allocate and the largest batch they hold.

Budget rules, read in the engines' sources:

- **SGLang** (``model_runner_kv_cache_mixin.py``, 0.5.14): the KV pool gets
  ``free after load − free before load × (1 − mem_fraction_static)``, i.e. ``before × fraction − weights``;
  the rest, ``before × (1 − fraction)``, is left for activations, CUDA graphs and the capture's buffers.
  "free before load" is the card's memory less the CUDA context and NCCL (:data:`CONTEXT_BYTES`).
- **vLLM** (``gpu_worker.determine_available_memory``): KV = total × ``gpu_memory_utilization`` − weights −
  the profiled activation peak − non-torch memory (:func:`vllm_activation_bytes`, a formula).

KV per token and per GPU: MLA keeps the latent ``kv_lora_rank + qk_rope_head_dim`` per layer whole on every
TP rank (unless attention is data-parallel); GQA/MHA keeps K and V of ``max(kv_heads / tp, 1)`` heads.
An EAGLE-3 draft adds its weights (replicated: SGLang and vLLM do not shard the one-layer draft's MLP by
default, a conservative count) and its own layers' KV per token to the same budget.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from eagle3_pipeline.fit.checkpoint import Weights
from eagle3_pipeline.fit.gpus import GIB
from eagle3_pipeline.target.folder import is_mla, text_config

Engine = Literal["sglang", "vllm"]
CONTEXT_BYTES = int(1.0 * GIB)  # CUDA context + NCCL buffers per GPU before weights (measured figures: 0.6–1.5 GiB)
KV_DTYPE_BYTES = {"auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
DEFAULT_FRACTION = {"sglang": 0.88, "vllm": 0.9}
VLLM_NON_TORCH = int(0.5 * GIB)
VLLM_BATCHED_TOKENS = 8192


class FitError(ValueError):
    """A setting the model cannot use: the message names it and what is expected."""


@dataclass(frozen=True)
class DraftShape:
    """An EAGLE-3 draft served beside the target: its weights and KV per token on each GPU."""

    weight_bytes: float
    kv_bytes_per_token: float


def kv_bytes(kv_dtype: str) -> int:
    if kv_dtype not in KV_DTYPE_BYTES:
        raise FitError(f"kv dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPE_BYTES)}")
    found = KV_DTYPE_BYTES[kv_dtype]
    # auto: the serving dtype, bfloat16 or float16 (a float32 checkpoint is served downcast to bfloat16)
    return found if found is not None else 2


def kv_per_token(raw: Mapping[str, Any], tp: int, kv_dtype: str = "auto", dp_attention: bool = False) -> float:
    """KV-cache bytes one token takes on each GPU (module doc)."""
    text = text_config(raw)
    layers = int(text["num_hidden_layers"])
    size = kv_bytes(kv_dtype)
    if is_mla(text):
        return (int(text["kv_lora_rank"]) + int(text["qk_rope_head_dim"])) * layers * size
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    ranks = 1 if dp_attention else tp
    per_rank = max(kv_heads / ranks, 1.0)
    return 2 * per_rank * head_dim * layers * size


def vllm_activation_bytes(raw: Mapping[str, Any], tp: int, batched_tokens: int = VLLM_BATCHED_TOKENS) -> float:
    """vLLM's profiled peak (a formula, not vLLM's profile): one forward of ``batched_tokens`` holds a few
    hidden-size buffers and one rank's MLP intermediate per token, in bf16."""
    text = text_config(raw)
    hidden = int(text["hidden_size"])
    inter = int(text.get("moe_intermediate_size") or text.get("intermediate_size") or 4 * hidden)
    experts = int(text.get("num_experts_per_tok") or 1)
    return batched_tokens * (8 * hidden + 4 * inter * experts / tp) * 2


@dataclass(frozen=True)
class ServingFit:
    """One engine on one GPU: the figures in bytes, and whether it starts."""

    engine: Engine
    tp: int
    gpu_bytes: int
    fraction: float
    weights: float
    draft_weights: float
    kv_per_token: float
    kv_pool: float
    reserve: float
    context_len: int

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_pool // self.kv_per_token)) if self.kv_per_token else 0

    @property
    def max_batch(self) -> int:
        """Requests of ``context_len`` tokens the pool holds at once."""
        return self.kv_tokens // max(self.context_len, 1)

    @property
    def fits(self) -> bool:
        return self.kv_pool > 0 and self.kv_tokens >= self.context_len

    def reason(self) -> str:
        gib = GIB
        if self.kv_pool <= 0:
            return (
                f"weights {self.weights / gib:.1f} GiB{self._draft()} per GPU exceed the engine's share "
                f"{self.fraction:g} × {self.usable / gib:.1f} GiB = {self.fraction * self.usable / gib:.1f} GiB: "
                "no memory left for the KV cache"
            )
        if not self.fits:
            return (
                f"a KV pool of {self.kv_tokens:,} tokens ({self.kv_pool / gib:.1f} GiB) cannot hold one request of "
                f"{self.context_len:,} tokens"
            )
        return (
            f"weights {self.weights / gib:.1f} GiB{self._draft()}, KV pool {self.kv_pool / gib:.1f} GiB = "
            f"{self.kv_tokens:,} tokens ({self.max_batch} requests of {self.context_len:,})"
        )

    def _draft(self) -> str:
        return f" + draft {self.draft_weights / GIB:.1f} GiB" if self.draft_weights else ""

    @property
    def usable(self) -> float:
        return self.gpu_bytes - CONTEXT_BYTES if self.engine == "sglang" else self.gpu_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "tp": self.tp,
            "gpu_gib": round(self.gpu_bytes / GIB, 2),
            "fraction": self.fraction,
            "weights_gib": round(self.weights / GIB, 3),
            "draft_weights_gib": round(self.draft_weights / GIB, 3),
            "kv_bytes_per_token": self.kv_per_token,
            "kv_pool_gib": round(self.kv_pool / GIB, 3),
            "kv_tokens": self.kv_tokens,
            "context_len": self.context_len,
            "max_batch": self.max_batch,
            "reserve_gib": round(self.reserve / GIB, 3),
            "fits": self.fits,
            "reason": self.reason(),
        }


def serving_fit(
    engine: Engine,
    weights: Weights,
    raw: Mapping[str, Any],
    *,
    tp: int,
    gpu_bytes: int,
    fraction: float | None = None,
    kv_dtype: str = "auto",
    context_len: int = 4096,
    draft: DraftShape | None = None,
    dp_attention: bool = False,
    weights_per_gpu: float | None = None,
    free_before_load: float | None = None,
) -> ServingFit:
    """The engine's budget on one of ``tp`` GPUs of ``gpu_bytes`` (module doc). ``weights_per_gpu`` and
    ``free_before_load`` replace the model's figures where they were measured (an engine's log)."""
    if engine not in ("sglang", "vllm"):
        raise FitError(f"engine {engine!r}: expected sglang or vllm")
    share = DEFAULT_FRACTION[engine] if fraction is None else fraction
    if not 0 < share < 1:
        raise FitError(f"memory fraction {share}: expected a number between 0 and 1")
    per_gpu = weights.per_gpu_bytes(tp, 1 if dp_attention else None) if weights_per_gpu is None else weights_per_gpu
    draft_weights = draft.weight_bytes if draft else 0.0
    per_token = kv_per_token(raw, tp, kv_dtype, dp_attention) + (draft.kv_bytes_per_token if draft else 0.0)
    if engine == "sglang":
        before = gpu_bytes - CONTEXT_BYTES if free_before_load is None else free_before_load
        pool = before * share - per_gpu - draft_weights
        reserve = before * (1 - share)
    else:
        reserve = vllm_activation_bytes(raw, tp) + VLLM_NON_TORCH
        pool = gpu_bytes * share - per_gpu - draft_weights - reserve
    return ServingFit(engine, tp, gpu_bytes, share, per_gpu, draft_weights, per_token, pool, reserve, context_len)


AUTO_CAPTURE_MAX = 0.95
AUTO_RESERVE_HEADROOM = 1.25  # an auto share leaves this much more than the formula's prefill memory


def capture_share(raw: Mapping[str, Any], tp: int, batch_tokens: int, before: float) -> float:
    """SGLang's --mem-fraction-static for the capture (auto): what is left beside the pool holds one prefill of
    ``batch_tokens`` with the headroom; at most 0.95. ``before``: free memory per GPU before the weights load."""
    reserve = capture_activation_bytes(raw, tp, batch_tokens) * AUTO_RESERVE_HEADROOM
    return min(AUTO_CAPTURE_MAX, math.floor((1 - reserve / before) * 1000) / 1000)


def capture_activation_bytes(raw: Mapping[str, Any], tp: int, batch_tokens: int) -> float:
    """What one prefill of ``batch_tokens`` holds beside the KV pool in SGLang's in-process capture (a formula):
    a few hidden-size bf16 buffers per token, one rank's MoE/MLP intermediate for the routed experts, and the
    captured aux + final states in float32 until they are copied out."""
    text = text_config(raw)
    hidden = int(text["hidden_size"])
    inter = int(text.get("moe_intermediate_size") or text.get("intermediate_size") or 4 * hidden)
    experts = int(text.get("num_experts_per_tok") or 1)
    per_token = 8 * hidden * 2 + 3 * inter * experts / tp * 2 + 4 * hidden * 4
    return batch_tokens * per_token + 2 * GIB  # + the allocator's fragmentation and NCCL workspace


def flag_value(args: Sequence[str], *flags: str) -> str | None:
    """The value of the last of ``flags`` in an argv (``--flag value`` or ``--flag=value``)."""
    found = None
    for i, arg in enumerate(args):
        for flag in flags:
            if arg == flag and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(flag + "="):
                found = arg.split("=", 1)[1]
    return found
