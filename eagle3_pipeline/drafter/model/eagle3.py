"""The EAGLE-3 draft model (``LlamaForCausalLMEagle3``) as SGLang serves it (``srt/models/llama_eagle3.py``)
and SpecForge trains it (``specforge/modeling/draft/llama3_eagle.py``; EAGLE-3 paper, arXiv:2503.01840).

One step of the drafter::

    h0     = fc(cat(aux_low, aux_mid, aux_high))                  # step 0 only
    x      = cat(input_layernorm(embed(tok)), hidden_norm(h))      # [.., 2H]
    h      = h + o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))     # residual = the un-normed h
    h      = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                                      # next step consumes pre-norm h

Variants (``DrafterConfig``, served by vLLM 0.32 and SGLang 0.5.23 alike): ``norm_before_fc`` normalises
the concatenated aux states with one RMSNorm (``input_norm``) before ``fc``; ``fc_norm`` (EAGLE-3.1) each
captured layer's state with its own (``fc_norm.{i}``); ``norm_output`` (EAGLE-3.1) feeds the next step
``norm(h)``, the state the logits are computed from, instead of the pre-norm ``h``.

Two ways to run it, which must agree (tested): :meth:`Eagle3Drafter.ttt_forward`, the unrolled
training-time test with the chain-drafting attention pattern (memory linear in the sequence length:
:mod:`eagle3_pipeline.drafter.model.attention`), and :meth:`Eagle3Drafter.forward_cached`, causal attention
over a key/value cache, one drafted token at a time, as a server drafts. Parameter names are the
servers' checkpoint names; RoPE is computed as the servers compute it (drafter/DESIGN.md, "The model").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle3_pipeline.drafter.model.attention import BlockCausalAttention
from eagle3_pipeline.drafter.model.draft_config import (
    YARN_BETA_FAST,
    YARN_BETA_SLOW,
    DrafterConfig,
    DrafterConfigError,
    rope_kind,
)
from eagle3_pipeline.drafter.model.mla import MLAAttention, mla_rope_factor
from eagle3_pipeline.drafter.model.norm import RMSNorm


def yarn_mscale(factor: float) -> float:
    """YaRN's attention factor ``0.1·ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_attention_factor(config: DrafterConfig) -> float:
    """What the servers multiply cos and sin by (q·k by its square): YaRN's ``0.1·ln(factor) + 1``, else 1
    (the MLA head: DeepSeek's ratio, :func:`~eagle3_pipeline.drafter.model.mla.mla_rope_factor`)."""
    if config.attention == "mla":
        return mla_rope_factor(config)
    scaling = config.rope_scaling or {}
    return yarn_mscale(float(scaling["factor"])) if rope_kind(scaling) == "yarn" else 1.0


def _yarn_correction_dim(rotations: float, dim: int, base: float, original_max: int) -> float:
    return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inverse_frequencies(config: DrafterConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim/2] in float32 (Llama rotate-half RoPE; linear, llama3 and
    YaRN scaling), in the servers' order of float32 operations; for the MLA head over
    ``qk_rope_head_dim`` (the servers' DeepSeek YaRN: the same blend, always truncated).

    YaRN (SGLang/vLLM ``YaRNScalingRotaryEmbedding._compute_inv_freq``, transformers
    ``_compute_yarn_parameters``): pair i keeps its frequency (extrapolation) below the correction range
    ``[low, high]`` of ``beta_fast``/``beta_slow`` rotations over ``original_max_position_embeddings``,
    is divided by ``factor`` (interpolation) above it, and blends linearly inside; with ``truncate``
    (default) low is floored and high ceiled, both clamped to [0, head_dim - 1].
    """
    dim = config.qk_rope_head_dim if config.attention == "mla" else config.head_dim
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


KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class Attention(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h, nh, nkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.scale = 1.0 / math.sqrt(hd)

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

    def cached_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q of the new tokens, keys and values of every cached token and the new ones (appended to ``cache``)."""
        q, k, v = self.qkv(x, cos, sin)
        if cache:
            k = torch.cat([cache[0][0], k], dim=2)
            v = torch.cat([cache[0][1], v], dim=2)
            cache[0] = (k, v)
        else:
            cache.append((k, v))
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
    """The one decoder layer, named ``midlayer`` in the checkpoint; its attention the Llama layer's or
    DeepSeek's MLA (``config.attention``, :mod:`eagle3_pipeline.drafter.model.mla`)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn: Attention | MLAAttention = (
            MLAAttention(config) if config.attention == "mla" else Attention(config)
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


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
        if config.norm_before_fc:
            self.input_norm = RMSNorm(3 * config.target_hidden_size, config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(3))
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

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The step-0 hidden stream from the captured states [.., 3·Ht], as the servers'
        ``combine_hidden_states`` (vLLM) / ``LlamaModel.forward`` (SGLang) compute it: the one norm over
        the concatenation (``norm_before_fc``), then a norm per captured layer (``fc_norm``), then ``fc``."""
        aux = aux.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, aux.chunk(3, dim=-1), strict=True)], -1)
        return self.fc(aux)

    def carried(self, layer_out: torch.Tensor) -> torch.Tensor:
        """What the next draft step consumes from this one's decoder-layer output: the pre-norm state, or
        with ``norm_output`` the final norm's output (the servers' ``aux`` / ``hidden_states_to_aux``)."""
        return self.norm(layer_out) if self.config.norm_output else layer_out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits from a step's carried state (:meth:`carried`): ``lm_head(norm(h))`` either way."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

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
        and the draft's own carried state of step j-1 at t (:meth:`carried`; :meth:`combine` of ``aux[t]``
        for step 0), sits
        at RoPE position t + j, and attends to the step-0 keys at indices <= t (not padding) plus
        the keys of steps 1..j at index t: exactly what chain drafting from prefix t sees.

        Memory stays linear in T: the step-0 keys are attended blockwise
        (:class:`~eagle3_pipeline.drafter.model.attention.BlockCausalAttention`, which also returns each row's
        log-sum-exp L_c), the diagonal scores s_i = q·k_i/√hd of steps
        1..j are one number per row, and the two merge exactly:
        out = e^(L_c − L)·out_c + Σ_i e^(s_i − L)·v_i with L = logsumexp(L_c, s_1..s_j).
        ``activation_checkpointing`` recomputes each step's decoder layer in the backward pass instead
        of keeping its activations (the step's keys/values and output hidden state are kept).
        """
        t = input_ids.shape[1]
        device = aux.device
        hidden = self.combine(aux)
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
        scale = attn_layer.scale
        attn, lse = BlockCausalAttention.apply(q, k0, v0, keys_visible, scale)
        if earlier:
            diagonal = [*earlier[1:], (k, v)]  # the keys of steps 1..j at the query's own index
            scores = torch.stack([torch.einsum("bngtd,bntd->bngt", q, dk).float() * scale for dk, _ in diagonal])
            lse_all = torch.logsumexp(torch.cat([lse[None], scores]), dim=0)
            attn = torch.exp(lse - lse_all)[..., None].to(q.dtype) * attn
            for score, (_, dv) in zip(scores, diagonal, strict=True):
                attn = attn + torch.exp(score - lse_all)[..., None].to(q.dtype) * dv[:, :, None]
        return self.carried(self.midlayer.finish(hidden, attn_layer.out(attn.flatten(1, 2)))), k, v

    # The training pass is the module's forward (DistributedDataParallel hooks ``forward``).
    forward = ttt_forward

    def forward_cached(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One server-style draft forward over new tokens [B, n] with their hidden stream [B, n, H]
        at ``positions`` [n]: causal attention over the cached keys plus the new ones; appends the
        new keys/values to ``cache`` (the MLA head: the latent and the rotated shared key). Returns
        (logits [B, n, Vd], the carried hidden [B, n, H])."""
        x = self.midlayer.attention_input(self.embed_tokens(input_ids), hidden)
        cos, sin = self.rope(positions)
        attn_layer = self.midlayer.self_attn
        q, k, v = attn_layer.cached_qkv(x, cos, sin, cache)
        n, total = q.shape[2], k.shape[2]
        visible = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=total - n)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True, scale=attn_layer.scale)
        out = self.carried(self.midlayer.finish(hidden, self.midlayer.self_attn.out(attn)))
        return self.logits(out), out
