"""Reference pieces for the drafter's tests and benchmarks: Kimi-K2.5's language-model config, the
server-side chain drafting, the TTT pass and loss as they were before the blockwise attention, and a
small random drafter.

Stand-ins: ``kimi_k25_text_config`` is the 1T target's ``text_config`` as a plain dict (no weights);
``tiny_kimi_text_config`` the same shape at toy size. ``reference_ttt_forward``/``reference_ttt_loss``
are the drafter's full-score training-time pass and loss (per step a [B, heads, T, T] score tensor
against the step-0 keys, the diagonal scores concatenated to it, one softmax; the loss's log-softmax
and soft labels as whole [N, Vd] float32 tensors), kept to check the blockwise pass against and to
measure as the old pass. ``chain_draft`` is what a server does with the exported drafter.
``tiny_drafter_config``, ``tiny_drafter`` and ``tiny_drafter_inputs``: a drafter small enough to
compare passes exactly, with random weights and vocabulary, and inputs for it. torch is imported
inside the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from eagle3_pipeline.drafter.model.draft_config import DrafterConfig
    from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
    from eagle3_pipeline.drafter.train.data import Batch

KIMI_POSITIONS = 262144  # Kimi-K2.5's max_position_embeddings = original 4096 × factor 64
KIMI_ROPE = {
    "type": "yarn",
    "factor": 64.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}
KIMI_AUX = [1, 29, 57]  # the EAGLE-3 default of a 61-layer target, output-of-layer


def kimi_k25_text_config(**overrides: Any) -> dict[str, Any]:
    """Kimi-K2.5's language model config (moonshotai/Kimi-K2.5's config.json, its nested ``text_config``)."""
    config: dict[str, Any] = {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
        "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 163840,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384, "num_experts_per_tok": 8,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 50000.0,
        "rope_scaling": dict(KIMI_ROPE), "max_position_embeddings": KIMI_POSITIONS, "rms_norm_eps": 1e-6,
        "bos_token_id": 163584, "eos_token_id": 163585, "tie_word_embeddings": False,
    }  # fmt: skip
    config.update(overrides)
    return config


def tiny_kimi_text_config(**overrides: Any) -> dict[str, Any]:
    """A Kimi-like language model config at toy size (MLA, YaRN ×4 over 64 original positions)."""
    tiny = {
        "hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 128,
        "intermediate_size": 512, "moe_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "rope_scaling": {**KIMI_ROPE, "factor": 4.0, "original_max_position_embeddings": 64},
        "max_position_embeddings": 256,
        "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    return kimi_k25_text_config(**{**tiny, **overrides})


def tiny_drafter_config(**overrides: object) -> DrafterConfig:
    """A small draft config (hidden 48, 6 heads of 8, vocabulary 80 drafting in 24, aux layers 1, 3, 4)."""
    from eagle3_pipeline.drafter.model.draft_config import DrafterConfig

    base: dict[str, Any] = dict(
        hidden_size=48, target_hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
        head_dim=8, vocab_size=80, draft_vocab_size=24, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=128, aux_layer_ids=[1, 3, 4],
    )  # fmt: skip
    base.update(overrides)
    return DrafterConfig(**base)  # type: ignore[arg-type]


def tiny_drafter(config: DrafterConfig) -> Eagle3Drafter:
    """The drafter of ``config`` with random weights (std 0.3, seed 0) and a random draft vocabulary."""
    import torch

    from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter

    torch.manual_seed(0)
    model = Eagle3Drafter(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    used = torch.sort(torch.randperm(config.vocab_size)[: config.draft_vocab_size]).values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    model.set_vocab(used - torch.arange(config.draft_vocab_size), t2d)
    return model.eval()


def tiny_drafter_inputs(config: DrafterConfig, b: int = 2, t: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    """Random aux states [b, t, 3·H] and token ids [b, t] for ``config``'s drafter (seed 1)."""
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(b, t, 3 * config.target_hidden_size, generator=g), torch.randint(
        0, config.vocab_size, (b, t), generator=g
    )


def chain_draft(model: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor, t: int, steps: int) -> list[torch.Tensor]:
    """What a server does after the target produced token t+1: extend the draft over the prefix
    (one forward, causal), then draft one token at a time against its KV cache. Also run on a GPU
    in bf16 by ``benchmarks/gpu_check.py``."""
    import torch

    cache: list = []
    logits, hidden = model.forward_cached(
        ids[:, 1 : t + 2], model.combine(aux[:, : t + 1]), torch.arange(t + 1, device=aux.device), cache
    )
    out = [logits[:, -1]]
    hidden = hidden[:, -1:]
    for j in range(1, steps):
        logits, hidden = model.forward_cached(
            ids[:, t + 1 + j : t + 2 + j], hidden, torch.tensor([t + j], device=aux.device), cache
        )
        out.append(logits[:, -1])
    return out


def reference_ttt_forward(
    model: Eagle3Drafter,
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    steps: int,
    attention_mask: torch.Tensor | None = None,
    keep: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The full-score TTT pass (``Eagle3Drafter.ttt_forward`` before the blockwise attention)."""
    import torch
    import torch.nn.functional as F

    b, t = input_ids.shape
    device = aux.device
    layer, attn_layer = model.midlayer, model.midlayer.self_attn
    groups = attn_layer.nh // attn_layer.nkv
    hidden = model.combine(aux)
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    allowed = (
        causal[None, None] if attention_mask is None else causal[None, None] & attention_mask.bool()[:, None, None, :]
    )
    scale = attn_layer.scale
    positions = torch.arange(t, device=device)
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    for j in range(steps):
        ids = F.pad(input_ids[:, j + 1 :], (0, j + 1))
        x = layer.attention_input(model.embed_tokens(ids), hidden)
        cos, sin = model.rope(positions + j)
        q, k, v = attn_layer.qkv(x, cos, sin)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if j == 0:
            k0, v0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        assert k0 is not None and v0 is not None
        scores = torch.matmul(q, k0.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        diag = [(q * dk).sum(-1, keepdim=True) * scale for dk in diag_k]
        probs = torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1).to(q.dtype)
        attn = torch.matmul(probs[..., :t], v0)
        for i, dv in enumerate(diag_v):
            attn = attn + probs[..., t + i : t + i + 1] * dv
        hidden = model.carried(layer.finish(hidden, attn_layer.out(attn)))
        outputs.append(model.logits(hidden if keep is None else hidden[keep[j]]))
    return outputs


def reference_ttt_loss(model: Eagle3Drafter, batch: Batch, lm_head: torch.Tensor, steps: int) -> torch.Tensor:
    """The weighted TTT loss of ``train.ttt_loss`` before the chunked loss, over the full-score pass."""
    import torch
    import torch.nn.functional as F

    from eagle3_pipeline.drafter.train.data import teacher
    from eagle3_pipeline.drafter.train.loss import STEP_DECAY

    target = teacher(batch.hidden, lm_head, model.t2d, F.pad(batch.loss_mask[:, 1:], (0, 1)))
    argmaxes = [F.pad(target.argmax[:, j + 1 :], (0, j + 1)) for j in range(steps)]
    trained = [F.pad(batch.loss_mask[:, j + 2 :], (0, j + 2)).float() for j in range(steps)]
    counted = [t * model.t2d[a].float() for t, a in zip(trained, argmaxes, strict=True)]
    counts = torch.stack([c.sum() for c in counted]).clamp(min=1.0)
    keep = [c.bool() for c in counted]
    logits = reference_ttt_forward(model, batch.aux, batch.input_ids, steps, batch.attention_mask, keep)
    total = torch.zeros((), device=batch.aux.device)
    for j, step_logits in enumerate(logits):
        probs = F.pad(target.probs[:, j + 1 :], (0, 0, 0, j + 1))[keep[j]]
        log_p = torch.log_softmax(step_logits.float(), dim=-1)
        total = total + (STEP_DECAY**j) * (-(probs * log_p).sum() / counts[j])
    return total
