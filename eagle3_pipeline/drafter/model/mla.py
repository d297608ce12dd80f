"""DeepSeek's multi-head latent attention as the MLA draft head's attention (``drafter.model.attention:
mla``), with the checkpoint names and numerics of vLLM 0.32 ``deepseek_eagle3.py`` (``DeepseekV2MLAAttention``)
and SGLang 0.5.23 ``models/kimi_k25_eagle3.py`` (``DeepseekV2AttentionMLA``)::

    x            = cat(input_layernorm(embed), hidden_norm(h))                  # [.., 2H]
    q            = q_b_proj(q_a_layernorm(q_a_proj(x)))                         # per head [nope | rope]
    latent, k_pe = kv_a_proj_with_mqa(x)  split [kv_lora_rank | qk_rope]        # the cached 576 per token
    k_nope, v    = kv_b_proj(kv_a_layernorm(latent))  per head [nope | v]
    k            = cat(k_nope, rope(k_pe) shared by every head);  q_pe = rope(q_pe)
    out          = o_proj(softmax(q·k · scale) v)

RoPE is the interleaved (GPT-J) rotation over ``qk_rope_head_dim``: pair (2i, 2i+1) turns by position ×
inv_freq[i] (``is_neox_style=False`` in both servers); with YaRN, cos and sin carry
``yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all_dim)`` and the softmax scale
``qk_head_dim^-0.5 · yarn_get_mscale(f, mscale_all_dim)²`` (:func:`mla_rope_factor`, :func:`mla_softmax_scale`).
Training decompresses the latent into per-head keys and values (:meth:`MLAAttention.qkv`: ordinary
multi-head attention with qk and v dims that differ, which the blockwise attention takes); serving
caches the latent and decompresses it per step (:meth:`MLAAttention.cached_qkv`), the same numbers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from eagle3_pipeline.drafter.model.draft_config import rope_kind
from eagle3_pipeline.drafter.model.norm import RMSNorm

if TYPE_CHECKING:
    from eagle3_pipeline.drafter.model.draft_config import DrafterConfig


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude ``0.1·mscale·ln(factor) + 1`` (1 for factor <= 1), DeepSeek's form."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_rope_factor(config: DrafterConfig) -> float:
    """What the servers' DeepSeek YaRN multiplies cos and sin by (1 without YaRN)."""
    scaling = config.rope_scaling or {}
    if rope_kind(scaling) != "yarn":
        return 1.0
    factor = float(scaling["factor"])
    return yarn_get_mscale(factor, float(scaling.get("mscale", 1))) / yarn_get_mscale(
        factor, float(scaling.get("mscale_all_dim", 0))
    )


def mla_softmax_scale(config: DrafterConfig) -> float:
    """``qk_head_dim^-0.5``, times ``yarn_get_mscale(factor, mscale_all_dim)²`` with YaRN."""
    scale = config.head_dim**-0.5
    scaling = config.rope_scaling or {}
    if rope_kind(scaling) == "yarn":
        scale *= yarn_get_mscale(float(scaling["factor"]), float(scaling.get("mscale_all_dim", 0))) ** 2
    return scale


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1)
    return pairs.flatten(-2)


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [.., T, d] rotated pairwise; cos/sin [T, d] as the drafter builds them (angles twice, first half used)."""
    half = x.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1).to(x.dtype)
    sin = sin[..., :half].repeat_interleave(2, dim=-1).to(x.dtype)
    return x * cos + _rotate_interleaved(x) * sin


class MLAAttention(nn.Module):
    """The MLA draft attention; the interface of the Llama layer's ``Attention`` (``qkv``,
    ``cached_qkv``, ``out``, ``nh``/``nkv``, ``scale``), with ``nkv = nh`` once decompressed."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h, nh = config.hidden_size, config.num_attention_heads
        self.nh = self.nkv = nh
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        self.scale = mla_softmax_scale(config)
        self.q_a_proj = nn.Linear(2 * h, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, nh * (self.nope + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, self.rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, h, bias=False)

    def latent(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, nh, T, nope + rope] (RoPE on its rope part), the normed latent [B, T, kv_lora_rank] and
        the rotated shared key part k_pe [B, T, rope]: what a server caches per token is the latter two."""
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, self.nh, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, _rope_interleaved(q_pe, cos, sin)], dim=-1)
        return q, self.kv_a_layernorm(latent), _rope_interleaved(k_pe, cos, sin)

    def expand(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [B, nh, T, nope + rope] and values [B, nh, T, v] from the cached latent and k_pe."""
        b, t, _ = latent.shape
        kv = self.kv_b_proj(latent).view(b, t, self.nh, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(b, self.nh, t, self.rope_dim)], dim=-1)
        return k, v

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, latent, k_pe = self.latent(x, cos, sin)
        return q, *self.expand(latent, k_pe)

    def cached_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q of the new tokens, keys and values of every cached token and the new ones; the cache holds
        (latent [B, T, kv_lora_rank], k_pe [B, T, rope]), kv_lora_rank + qk_rope_head_dim per token."""
        q, latent, k_pe = self.latent(x, cos, sin)
        if cache:
            latent = torch.cat([cache[0][0], latent], dim=1)
            k_pe = torch.cat([cache[0][1], k_pe], dim=1)
            cache[0] = (latent, k_pe)
        else:
            cache.append((latent, k_pe))
        return q, *self.expand(latent, k_pe)

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.nh * self.v_dim))
