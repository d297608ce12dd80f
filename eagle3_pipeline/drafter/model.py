"""The EAGLE-3 draft model (``LlamaForCausalLMEagle3``) as SGLang serves it (``srt/models/llama_eagle3.py``)
and SpecForge trains it (``specforge/modeling/draft/llama3_eagle.py``; EAGLE-3 paper, arXiv:2503.01840).

One step of the drafter::

    h0     = fc(cat(aux_low, aux_mid, aux_high))                  # step 0 only
    x      = cat(input_layernorm(embed(tok)), hidden_norm(h))      # [.., 2H]
    h      = h + o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))     # residual = the un-normed h
    h      = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                                      # next step consumes pre-norm h

Two ways to run it, which must agree (tested): :meth:`Eagle3Drafter.ttt_forward`, the unrolled
training-time test with the chain-drafting attention pattern, and :meth:`Eagle3Drafter.forward_cached`,
plain causal attention over a key/value cache, one drafted token at a time, as a server drafts.
The training pass's memory is linear in the sequence length: its causal attention runs blockwise
(:class:`_BlockCausalAttention`, which never holds a T×T score tensor) and merges the chain-drafting
keys in exactly by log-sum-exp; :func:`soft_label_cross_entropy` is the training loss over the draft
head's logits in chunks.

Parameter names are the servers' checkpoint names (``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``, buffers ``d2t`` and ``t2d``); ``embed_tokens.weight`` is the target's, frozen.

RoPE is computed as the servers compute it for a Llama EAGLE-3 drafter (SGLang ``LlamaAttention`` →
``get_rope``, vLLM ``llama_eagle3`` → ``get_rope``): rotate-half, ``rope_theta`` and ``rope_scaling``
from the drafter's config.json, in float32, the cos/sin multiplied by the scaling's attention factor.
YaRN (``rope_type``/``type`` ``yarn``) is :func:`rope_inverse_frequencies` and
:func:`rope_attention_factor`; :func:`yarn_for_servers` writes the one YaRN dict every reader
interprets alike (see there).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class DrafterConfigError(ValueError):
    """A draft-model configuration that cannot be built (names the field and what was expected)."""


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    aux_layer_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.aux_layer_ids) != 3:
            raise DrafterConfigError(f"aux_layer_ids: expected 3 captured target layers, got {self.aux_layer_ids}")
        rope_type = rope_kind(self.rope_scaling)
        if rope_type not in SUPPORTED_ROPE:
            raise DrafterConfigError(
                f"rope_scaling.rope_type {rope_type!r} is not supported; expected one of {sorted(SUPPORTED_ROPE)}"
            )
        if rope_type == "yarn":
            _check_portable_yarn(self.rope_scaling or {})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DrafterConfig:
        return cls(**{**raw, "aux_layer_ids": list(raw["aux_layer_ids"])})


SUPPORTED_ROPE = {"default", "linear", "llama3", "yarn"}
YARN_BETA_FAST, YARN_BETA_SLOW = 32, 1  # the servers' defaults (SGLang, vLLM, transformers)
# The (mscale, mscale_all_dim) pair every reader of a Llama config turns into YaRN's 0.1·ln(factor) + 1:
# SGLang 0.5.14 ignores both; SGLang 0.5.23 takes yarn_get_mscale(f, 1) / yarn_get_mscale(f, 0); vLLM
# 0.34 and transformers 5 need both truthy for the ratio (0 is not) and fall back to yarn_get_mscale(f);
# SpecForge 0.2.0 always takes the ratio and fails when either is missing.
PORTABLE_MSCALE = {"mscale": 1.0, "mscale_all_dim": 0.0}
# Keys some server reads and another ignores (SGLang: attn_factor, extrapolation_factor; vLLM and
# transformers: attention_factor): no value of them is served alike, so a drafter never carries them.
UNPORTABLE_YARN_KEYS = ("attn_factor", "attention_factor", "extrapolation_factor")
YARN_KEYS = {
    "rope_type",
    "type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "truncate",
    *PORTABLE_MSCALE,
}


def rope_kind(scaling: dict[str, Any] | None) -> str:
    """``rope_type`` (or legacy ``type``) of a ``rope_scaling`` dict; ``default`` for none."""
    scaling = scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _check_portable_yarn(scaling: dict[str, Any], where: str = "rope_scaling") -> None:
    unportable = sorted(set(scaling) & set(UNPORTABLE_YARN_KEYS))
    if unportable:
        raise DrafterConfigError(
            f"{where}: {unportable} are read by some servers and ignored by others (SGLang reads attn_factor and "
            "extrapolation_factor, vLLM attention_factor); leave them out: the drafter's YaRN attention factor is "
            "0.1·ln(factor) + 1"
        )
    unknown = sorted(set(scaling) - YARN_KEYS)
    if unknown:
        raise DrafterConfigError(f"{where}: unknown YaRN keys {unknown}; expected a subset of {sorted(YARN_KEYS)}")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise DrafterConfigError(f"{where}.{key}: required for rope_type yarn (vLLM reads it without a default)")
    if "type" in scaling and "rope_type" in scaling and scaling["type"] != scaling["rope_type"]:
        raise DrafterConfigError(f"{where}: type {scaling['type']!r} and rope_type {scaling['rope_type']!r} differ")
    for key, portable in PORTABLE_MSCALE.items():
        if key in scaling and float(scaling[key]) != portable:
            raise DrafterConfigError(
                f"{where}.{key} {scaling[key]}: servers read mscale/mscale_all_dim differently (SGLang 0.5.14 "
                f"ignores them, SGLang 0.5.23 and vLLM take a ratio); expected {portable} or none "
                "(yarn_for_servers writes the pair)"
            )


def yarn_for_servers(scaling: dict[str, Any], where: str) -> dict[str, Any]:
    """The drafter's YaRN ``rope_scaling`` built from a target's (or an override's): what the drafter
    trains with and what its config.json says, interpreted alike by SGLang 0.5.14 and 0.5.23, vLLM 0.34,
    transformers 5 and SpecForge 0.2.0.

    What a server does with a Llama drafter's ``rope_scaling: yarn`` (SGLang ``get_rope`` →
    ``YaRNScalingRotaryEmbedding``; vLLM ``get_rope`` → ``YaRNScalingRotaryEmbedding``): the inverse
    frequencies are the YaRN blend (:func:`rope_inverse_frequencies`) over ``head_dim`` with ``factor``,
    ``original_max_position_embeddings`` (both required by vLLM), ``beta_fast``/``beta_slow`` (default
    32/1) and ``truncate`` (default true); cos and sin are multiplied by an attention factor ``m``, so q·k
    is multiplied by ``m²``. ``m`` is where the readers differ: SGLang 0.5.14 reads only ``attn_factor``
    (``m = (0.1·ln f + 1)·attn_factor``; it also reads ``extrapolation_factor``, vLLM does not); SGLang
    0.5.23 uses ``yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all_dim)`` when both are given;
    vLLM 0.34 and transformers use ``attention_factor`` if given, else that ratio when both are truthy,
    else ``0.1·ln f + 1``; SpecForge always takes the ratio and fails without both keys. The one setting
    they agree on is ``mscale: 1, mscale_all_dim: 0`` (:data:`PORTABLE_MSCALE`) and no
    attn_factor/attention_factor: every one of them then applies ``m = 0.1·ln(factor) + 1``.

    Why that keeps a DeepSeek-V3/Kimi target's attention temperature: transformers' DeepSeek-V3 multiplies
    cos/sin by ``yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all_dim)`` and its softmax scale by
    ``yarn_get_mscale(f, mscale_all_dim)²`` (MLA scales the non-rotary dims too), so its q·k carries
    ``yarn_get_mscale(f, mscale)²`` whatever ``mscale_all_dim`` is; the drafter's ``m²`` equals it exactly
    when ``mscale`` is 1 (Kimi-K2.5 and DeepSeek-V3: factor 64, m² = 2.0047;
    eagle3_pipeline_tests/drafter/test_yarn.py). So ``mscale_all_dim`` is dropped, and an ``mscale`` other
    than 1, which no portable key can express, is refused. The frequencies are computed over the drafter's
    ``head_dim`` (128 for an MLA target's draft, :func:`eagle3_pipeline.drafter.train.drafter_config`)
    where the target rotates ``qk_rope_head_dim`` (64) dims: the same YaRN settings over another dimension,
    as the servers do.
    """
    raw = dict(scaling)
    if float(raw.pop("mscale", 1.0)) != 1.0:
        raise DrafterConfigError(
            f"{where}.mscale {scaling['mscale']}: a Llama drafter can be served with YaRN's attention factor "
            "0.1·ln(factor) + 1 only (mscale 1); set drafter.model.rope_scaling without mscale"
        )
    raw.pop("mscale_all_dim", None)
    raw.pop("rope_theta", None)  # transformers 5 keeps it in rope_parameters; the drafter carries it as rope_theta
    _check_portable_yarn(raw, where)
    out: dict[str, Any] = {
        "rope_type": "yarn",
        "type": "yarn",
        "factor": float(raw["factor"]),
        "original_max_position_embeddings": int(raw["original_max_position_embeddings"]),
        "beta_fast": raw.get("beta_fast", YARN_BETA_FAST),
        "beta_slow": raw.get("beta_slow", YARN_BETA_SLOW),
        **PORTABLE_MSCALE,
    }
    if "truncate" in raw:
        out["truncate"] = bool(raw["truncate"])
    return out


def target_rope(target_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of a Hugging Face config, old (``rope_theta``/``rope_scaling``)
    or transformers-5 style (``rope_parameters``)."""
    params = target_config.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", target_config.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return theta, (None if rope_kind(scaling) == "default" else scaling)
    scaling = target_config.get("rope_scaling")
    return float(target_config.get("rope_theta", 10000.0)), (None if rope_kind(scaling) == "default" else scaling)


def yarn_mscale(factor: float) -> float:
    """YaRN's attention factor ``0.1·ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_attention_factor(config: DrafterConfig) -> float:
    """What the servers multiply cos and sin by (q·k by its square): YaRN's ``0.1·ln(factor) + 1``, else 1."""
    scaling = config.rope_scaling or {}
    return yarn_mscale(float(scaling["factor"])) if rope_kind(scaling) == "yarn" else 1.0


def _yarn_correction_dim(rotations: float, dim: int, base: float, original_max: int) -> float:
    return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inverse_frequencies(config: DrafterConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim/2] in float32 (Llama rotate-half RoPE; linear, llama3 and
    YaRN scaling), in the servers' order of float32 operations.

    YaRN (SGLang/vLLM ``YaRNScalingRotaryEmbedding._compute_inv_freq``, transformers
    ``_compute_yarn_parameters``): pair i keeps its frequency (extrapolation) below the correction range
    ``[low, high]`` of ``beta_fast``/``beta_slow`` rotations over ``original_max_position_embeddings``,
    is divided by ``factor`` (interpolation) above it, and blends linearly inside; with ``truncate``
    (default) low is floored and high ceiled, both clamped to [0, head_dim - 1].
    """
    dim = config.head_dim
    pos_freqs = config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv = 1.0 / pos_freqs
    scaling = config.rope_scaling or {}
    kind = rope_kind(scaling)
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor, low, high = (
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
        )
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where((wavelen <= old / low) & (wavelen >= old / high), mid, scaled)
    elif kind == "yarn":
        factor, original_max = float(scaling["factor"]), int(scaling["original_max_position_embeddings"])
        low = _yarn_correction_dim(scaling.get("beta_fast", YARN_BETA_FAST), dim, config.rope_theta, original_max)
        high = _yarn_correction_dim(scaling.get("beta_slow", YARN_BETA_SLOW), dim, config.rope_theta, original_max)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # the servers' guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolated = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + inv * extrapolated
    return inv


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h, nh, nkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, nh, T, hd], k and v [B, nkv, T, hd] (query head h reads KV head h // (nh / nkv)), RoPE
        applied to q and k."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """The one decoder layer, named ``midlayer`` in the checkpoint."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# The training-time test's causal attention takes ATTENTION_BLOCK query rows at a time, against key
# blocks of at most ATTENTION_SCORE_ELEMENTS scores (B · heads · query rows · key rows; at least
# ATTENTION_BLOCK key rows): one block's scores are the largest tensors it holds, whatever T.
ATTENTION_BLOCK = 512
ATTENTION_SCORE_ELEMENTS = 1 << 26
# Logits per chunk of the soft-label loss: the float32 log-probabilities of one chunk (64 MiB).
LOSS_CHUNK_ELEMENTS = 1 << 24
_MASKED = torch.finfo(torch.float32).min


def _query_blocks(length: int) -> list[tuple[int, int]]:
    return [(start, min(start + ATTENTION_BLOCK, length)) for start in range(0, length, ATTENTION_BLOCK)]


def _key_blocks(q_end: int, width: int) -> list[tuple[int, int]]:
    """Key blocks covering keys 0..q_end-1 for ``width`` = B · heads · query rows: as long as the
    score budget allows, in multiples of ATTENTION_BLOCK."""
    size = max(ATTENTION_BLOCK, ATTENTION_SCORE_ELEMENTS // width // ATTENTION_BLOCK * ATTENTION_BLOCK)
    return [(start, min(start + size, q_end)) for start in range(0, q_end, size)]


def _block_scores(
    q: torch.Tensor, k: torch.Tensor, q_start: int, k_start: int, keys_visible: torch.Tensor | None
) -> torch.Tensor:
    """float32 scores [B, nkv, g, bq, bk] of the scaled queries q [B, nkv, g, bq, hd] at q_start.. against
    keys k [B, nkv, bk, hd] at k_start..; keys after the query, or not visible (padding), get the float32
    minimum (as a full-score pass's masked_fill: zero weight, and a row with no key left averages)."""
    scores = torch.einsum("bngqd,bnkd->bngqk", q, k).float()
    if k_start + k.shape[2] - 1 > q_start:  # the causal edge crosses this block
        q_pos = torch.arange(q_start, q_start + q.shape[3], device=q.device)
        k_pos = torch.arange(k_start, k_start + k.shape[2], device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], _MASKED)
    if keys_visible is not None:
        scores.masked_fill_(~keys_visible[:, None, None, None, k_start : k_start + k.shape[2]], _MASKED)
    return scores


def _softmax_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    keys: tuple[int, int],
    keys_visible: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key block's softmax pieces for the query block q: row maxima m, Σ exp(s − m), Σ exp(s − m)·v."""
    k_start, k_end = keys
    scores = _block_scores(q, k[:, :, k_start:k_end], q_start, k_start, keys_visible)
    peak = scores.amax(-1)
    weights = scores.sub_(peak[..., None]).exp_()
    return peak, weights.sum(-1), torch.einsum("bngqk,bnkd->bngqd", weights.to(v.dtype), v[:, :, k_start:k_end]).float()


class _BlockCausalAttention(torch.autograd.Function):
    """Causal attention over the visible keys and its per-row log-sum-exp, flash-attention style in
    plain PyTorch: :data:`ATTENTION_BLOCK` query rows at a time, an online softmax over the key blocks
    up to the query block's end (:func:`_key_blocks`). Forward and backward hold O(T · head_dim) per
    head plus one block's scores, never a T×T tensor.

    q [B, nkv, g, T, hd] (the g query heads of each KV head), k and v [B, nkv, T, hd], keys_visible
    [B, T] bool or None (all visible). Returns out like q and lse [B, nkv, g, T] float32. Backward takes
    the gradients of both: with P the attention weights and D = rowsum(dO ∘ O), dS = P ∘ (dP − D + dlse)
    since ∂lse/∂S = P. Scores, softmax statistics and gradient sums are float32; matmuls run in the
    inputs' dtype (autocast off inside: the backward needs the forward's dtypes, whichever thread runs it).
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys_visible: torch.Tensor | None, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(q.device.type, enabled=False):
            scaled = q * scale
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
            for q_start, q_end in _query_blocks(q.shape[3]):
                qb = scaled[:, :, :, q_start:q_end]
                first, *rest = _key_blocks(q_end, qb[..., 0].numel())
                peak, total, acc = _softmax_block(qb, k, v, q_start, first, keys_visible)
                for block in rest:  # merge the block's softmax into the running one
                    block_peak, block_total, block_acc = _softmax_block(qb, k, v, q_start, block, keys_visible)
                    new_peak = torch.maximum(peak, block_peak)
                    old_weight, block_weight = torch.exp(peak - new_peak), torch.exp(block_peak - new_peak)
                    total = total * old_weight + block_total * block_weight
                    acc = acc * old_weight[..., None] + block_acc * block_weight[..., None]
                    peak = new_peak
                out[:, :, :, q_start:q_end] = (acc / total[..., None]).to(q.dtype)
                lse[:, :, :, q_start:q_end] = peak + total.log()
        ctx.save_for_backward(q, k, v, out, lse, keys_visible)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, keys_visible = ctx.saved_tensors
        scale = ctx.scale
        with torch.autocast(q.device.type, enabled=False):
            scaled = q * scale
            grad_out = grad_out.to(q.dtype)
            delta = (grad_out.float() * out.float()).sum(-1) - grad_lse
            d_scaled = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
            for q_start, q_end in _query_blocks(q.shape[3]):
                qb, gb = scaled[:, :, :, q_start:q_end], grad_out[:, :, :, q_start:q_end]
                lse_b, delta_b = lse[:, :, :, q_start:q_end, None], delta[:, :, :, q_start:q_end, None]
                for k_start, k_end in _key_blocks(q_end, qb[..., 0].numel()):
                    kb, vb = k[:, :, k_start:k_end], v[:, :, k_start:k_end]
                    weights = _block_scores(qb, kb, q_start, k_start, keys_visible).sub_(lse_b).exp_()
                    dv[:, :, k_start:k_end] += torch.einsum("bngqk,bngqd->bnkd", weights.to(v.dtype), gb).float()
                    d_scores = torch.einsum("bngqd,bnkd->bngqk", gb, vb).float().sub_(delta_b).mul_(weights).to(q.dtype)
                    d_scaled[:, :, :, q_start:q_end] += torch.einsum("bngqk,bnkd->bngqd", d_scores, kb).float()
                    dk[:, :, k_start:k_end] += torch.einsum("bngqk,bngqd->bnkd", d_scores, qb).float()
        return (d_scaled * scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class _SoftLabelCrossEntropy(torch.autograd.Function):
    """Σ_n −Σ_v probs[rows[n], v] · log_softmax(logits[n])_v, in chunks of rows: the float32
    log-probabilities exist one chunk at a time, forward and backward (d/dlogits = softmax · Σ_v p − p),
    and the soft labels are gathered from ``probs`` by row, never copied whole."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, chunk_rows: int
    ) -> torch.Tensor:
        with torch.autocast(logits.device.type, enabled=False):
            total = torch.zeros((), dtype=torch.float32, device=logits.device)
            for start in range(0, logits.shape[0], chunk_rows):
                labels = probs.index_select(0, rows[start : start + chunk_rows])
                total = total - (labels * torch.log_softmax(logits[start : start + chunk_rows].float(), dim=-1)).sum()
        ctx.save_for_backward(logits, probs, rows)
        ctx.chunk_rows = chunk_rows
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, probs, rows = ctx.saved_tensors
        chunk_rows = ctx.chunk_rows
        grad_logits = torch.empty_like(logits)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], chunk_rows):
                labels = probs.index_select(0, rows[start : start + chunk_rows])
                softmax = torch.softmax(logits[start : start + chunk_rows].float(), dim=-1)
                grad_logits[start : start + chunk_rows] = (grad * (softmax * labels.sum(-1, keepdim=True) - labels)).to(
                    logits.dtype
                )
        return grad_logits, None, None, None


def soft_label_cross_entropy(
    logits: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """The summed soft-label cross-entropy of ``logits`` [N, Vd] against the rows ``rows`` [N] of
    ``probs`` [M, Vd] (the teacher's distributions), computed in chunks of ``chunk_rows`` rows
    (default: :data:`LOSS_CHUNK_ELEMENTS` logits a chunk)."""
    return _SoftLabelCrossEntropy.apply(
        logits, probs, rows, chunk_rows or max(1, LOSS_CHUNK_ELEMENTS // logits.shape[-1])
    )


KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class Eagle3Drafter(nn.Module):
    # The buffers registered in __init__ (nn.Module's attribute lookup does not type them).
    d2t: torch.Tensor
    t2d: torch.Tensor
    inv_freq: torch.Tensor

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.midlayer = DecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.rope_scale = rope_attention_factor(config)

    @property
    def embedding_frozen(self) -> bool:
        return not self.embed_tokens.weight.requires_grad

    def set_target_embedding(self, weight: torch.Tensor) -> None:
        """Copy the target's input embedding [V, H] and freeze it (as SpecForge's ``freeze_embedding`` does)."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise DrafterConfigError(
                f"target embedding has shape {tuple(weight.shape)}, expected {expected} (vocab_size, hidden_size)"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)
        self.embed_tokens.weight.requires_grad_(False)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise DrafterConfigError(
                f"draft vocabulary shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match the model "
                f"({self.config.draft_vocab_size}, {self.config.vocab_size})"
            )
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] for integer positions [T], times the attention factor (YaRN) as the
        servers' cos/sin caches hold them."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos() * self.rope_scale, emb.sin() * self.rope_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def draft_target_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy draft ids mapped to target ids (argmax + d2t)."""
        draft = logits.argmax(dim=-1)
        return draft + self.d2t[draft]

    def ttt_forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int,
        attention_mask: torch.Tensor | None = None,
        keep: list[torch.Tensor] | None = None,
        activation_checkpointing: bool = False,
    ) -> list[torch.Tensor]:
        """The unrolled training-time test (SpecForge's ``OnlineEagle3Model``): ``steps`` logits tensors
        [B, T, Vd], or with ``keep`` (one bool mask [B, T] per step) only the kept indices' logits [N_j, Vd],
        in row-major order: training needs the draft head only where the loss counts.

        Step j at index t consumes token ``input_ids[t + 1 + j]`` (teacher forced; 0 past the end)
        and the draft's own pre-norm hidden state of step j-1 at t (``fc(aux[t])`` for step 0), sits
        at RoPE position t + j, and attends to the step-0 keys at indices <= t (not padding) plus
        the keys of steps 1..j at index t: exactly what chain drafting from prefix t sees.

        Memory stays linear in T: the step-0 keys are attended blockwise (:class:`_BlockCausalAttention`,
        which also returns each row's log-sum-exp L_c), the diagonal scores s_i = q·k_i/√hd of steps
        1..j are one number per row, and the two merge exactly:
        out = e^(L_c − L)·out_c + Σ_i e^(s_i − L)·v_i with L = logsumexp(L_c, s_1..s_j).
        ``activation_checkpointing`` recomputes each step's decoder layer in the backward pass instead
        of keeping its activations (the step's keys/values and output hidden state are kept).
        """
        t = input_ids.shape[1]
        device = aux.device
        hidden = self.fc(aux.to(self.fc.weight.dtype))
        keys_visible = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
        positions = torch.arange(t, device=device)
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        outputs: list[torch.Tensor] = []
        for j in range(steps):
            ids = F.pad(input_ids[:, j + 1 :], (0, j + 1))
            cos, sin = self.rope(positions + j)
            if activation_checkpointing:
                hidden, k, v = checkpoint(
                    self._ttt_step, ids, hidden, cos, sin, keys_visible, list(keys), use_reentrant=False
                )
            else:
                hidden, k, v = self._ttt_step(ids, hidden, cos, sin, keys_visible, keys)
            keys.append((k, v))
            outputs.append(self.logits(hidden if keep is None else hidden[keep[j]]))
        return outputs

    def _ttt_step(
        self,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys_visible: torch.Tensor | None,
        earlier: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One TTT step's decoder layer: (hidden out, this step's k, v). ``earlier`` holds the keys and
        values of the steps before (none at step 0); see :meth:`ttt_forward` for the attention."""
        attn_layer = self.midlayer.self_attn
        q, k, v = attn_layer.qkv(self.midlayer.attention_input(self.embed_tokens(ids), hidden), cos, sin)
        k0, v0 = earlier[0] if earlier else (k, v)
        q = q.unflatten(1, (attn_layer.nkv, attn_layer.nh // attn_layer.nkv))  # [B, nkv, g, T, hd]
        scale = 1.0 / math.sqrt(self.config.head_dim)
        attn, lse = _BlockCausalAttention.apply(q, k0, v0, keys_visible, scale)
        if earlier:
            diagonal = [*earlier[1:], (k, v)]  # the keys of steps 1..j at the query's own index
            scores = torch.stack([torch.einsum("bngtd,bntd->bngt", q, dk).float() * scale for dk, _ in diagonal])
            lse_all = torch.logsumexp(torch.cat([lse[None], scores]), dim=0)
            attn = torch.exp(lse - lse_all)[..., None].to(q.dtype) * attn
            for score, (_, dv) in zip(scores, diagonal, strict=True):
                attn = attn + torch.exp(score - lse_all)[..., None].to(q.dtype) * dv[:, :, None]
        return self.midlayer.finish(hidden, attn_layer.out(attn.flatten(1, 2))), k, v

    # The training pass is the module's forward (DistributedDataParallel hooks ``forward``).
    forward = ttt_forward

    def forward_cached(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One server-style draft forward over new tokens [B, n] with their hidden stream [B, n, H]
        at ``positions`` [n]: causal attention over the cached keys plus the new ones; appends the
        new keys/values to ``cache``. Returns (logits [B, n, Vd], pre-norm hidden [B, n, H])."""
        x = self.midlayer.attention_input(self.embed_tokens(input_ids), hidden)
        cos, sin = self.rope(positions)
        q, k, v = self.midlayer.self_attn.qkv(x, cos, sin)
        if cache:
            k = torch.cat([cache[0][0], k], dim=2)
            v = torch.cat([cache[0][1], v], dim=2)
            cache[0] = (k, v)
        else:
            cache.append((k, v))
        n, total = q.shape[2], k.shape[2]
        visible = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=total - n)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        out = self.midlayer.finish(hidden, self.midlayer.self_attn.out(attn))
        return self.logits(out), out
