"""The MLA draft head (``drafter.model.attention: mla``): training's unrolled pass drafts what a server's
cached pass drafts, the blockwise attention equals the full-score one with MLA's unequal qk/v dims
(forward and gradients), the cache is the latent, and the config takes the target's MLA dims or refuses."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
import torch

from eagle3_pipeline.drafter.model.draft_config import (
    DrafterConfigError,
    drafter_config,
    kv_cache_elements_per_token,
)
from eagle3_pipeline.drafter.model.mla import MLAAttention, mla_rope_factor, mla_softmax_scale, yarn_get_mscale
from eagle3_pipeline.drafter.spec import TrainError
from eagle3_pipeline.testing.drafter_reference import (
    KIMI_AUX,
    chain_draft,
    kimi_k25_text_config,
    reference_ttt_forward,
    tiny_drafter,
    tiny_drafter_inputs,
    tiny_kimi_text_config,
)

STEPS = 4
MLA = {"attention": "mla"}


def _tiny_mla(**overrides: object):
    target = tiny_kimi_text_config(hidden_size=48, intermediate_size=96)
    return drafter_config(target, 24, [1, 3, 4], {**MLA, **overrides})


@pytest.mark.parametrize("variant", [{}, {"fc_norm": True, "norm_output": True}])
def test_mla_chain_drafting_with_a_latent_cache_equals_the_unrolled_ttt_pass(variant: dict) -> None:
    """Positions run past the YaRN original context (64), so the DeepSeek YaRN frequencies all count."""
    config = _tiny_mla(**variant)
    model = tiny_drafter(config)
    assert isinstance(model.midlayer.self_attn, MLAAttention)
    aux, ids = tiny_drafter_inputs(config, b=2, t=80)
    with torch.no_grad():
        unrolled = model.ttt_forward(aux, ids, STEPS)
        for t in (0, 1, 37, 70, ids.shape[1] - STEPS - 2):
            chained = chain_draft(model, aux, ids, t, STEPS)
            for j in range(STEPS):
                torch.testing.assert_close(chained[j], unrolled[j][:, t], rtol=1e-5, atol=1e-5)


def test_mla_blockwise_pass_and_gradients_equal_the_full_score_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small attention blocks, so the online softmax merges several key blocks (qk dim 24, v dim 16); in
    float64, against the reference's float32 softmax: equal to 1e-5 of each gradient's scale."""
    from eagle3_pipeline.drafter.model import attention

    monkeypatch.setattr(attention, "ATTENTION_BLOCK", 8)
    monkeypatch.setattr(attention, "ATTENTION_SCORE_ELEMENTS", 8 * 8 * 4 * 2)
    config = _tiny_mla(fc_norm=True)
    model = tiny_drafter(config).double()
    aux, ids = tiny_drafter_inputs(config, b=2, t=30)
    aux = aux.double()
    mask = torch.ones(ids.shape, dtype=torch.bool)
    mask[1, 22:] = False

    def grads(forward) -> list[torch.Tensor]:
        model.zero_grad()
        torch.stack([out.pow(2).mean() for out in forward(model, aux, ids, STEPS, mask)]).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ours = grads(lambda m, *a: m.ttt_forward(*a))
    ref = grads(reference_ttt_forward)
    assert len(ours) == len(ref) > 10
    for a, b in zip(ours, ref, strict=True):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


def test_the_cache_holds_the_latent_and_the_shared_rope_key() -> None:
    config = _tiny_mla()
    model = tiny_drafter(config)
    aux, ids = tiny_drafter_inputs(config, b=1, t=9)
    cache: list = []
    with torch.no_grad():
        model.forward_cached(ids, model.combine(aux), torch.arange(9), cache)
    ((latent, k_pe),) = cache
    assert latent.shape == (1, 9, config.kv_lora_rank) and k_pe.shape == (1, 9, config.qk_rope_head_dim)
    assert kv_cache_elements_per_token(config) == config.kv_lora_rank + config.qk_rope_head_dim == 24


def test_kimi_dims_and_the_kv_cache_per_token_against_the_llama_style_draft() -> None:
    """On Kimi-K2.5's text_config: the MLA head takes its dims; 576 cached elements per token against
    2,048 for the pipeline's GQA default (8 KV heads × 128, keys and values) and 16,384 for the published
    64-KV-head Llama-style drafts."""
    target = kimi_k25_text_config()
    mla = drafter_config(target, 32000, KIMI_AUX, MLA)
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        1536, 512, 128, 64, 128,
    )  # fmt: skip
    assert (mla.num_attention_heads, mla.num_key_value_heads, mla.head_dim, mla.intermediate_size) == (
        64,
        64,
        192,
        18432,
    )
    assert mla.rope_scaling is not None and mla.rope_scaling["mscale_all_dim"] == 1.0  # DeepSeek form, kept
    gqa = drafter_config(target, 32000, KIMI_AUX, {})
    published = drafter_config(target, 32000, KIMI_AUX, {"num_attention_heads": 64, "num_key_value_heads": 64})
    assert [kv_cache_elements_per_token(c) for c in (mla, gqa, published)] == [576, 2048, 16384]
    # Kimi: mscale = mscale_all_dim = 1, so cos/sin carry 1 and q·k carries (0.1·ln 64 + 1)² over √192.
    assert mla_rope_factor(mla) == 1.0
    assert mla_softmax_scale(mla) == pytest.approx(192**-0.5 * yarn_get_mscale(64.0, 1.0) ** 2)


def test_mla_parameters_have_the_servers_names_and_shapes() -> None:
    config = _tiny_mla()
    model = tiny_drafter(config)
    attn = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("midlayer.self_attn.")}
    h2, nh = 2 * 48, config.num_attention_heads
    assert attn == {
        "midlayer.self_attn.q_a_proj.weight": (config.q_lora_rank, h2),
        "midlayer.self_attn.q_a_layernorm.weight": (config.q_lora_rank,),
        "midlayer.self_attn.q_b_proj.weight": (nh * 24, config.q_lora_rank),
        "midlayer.self_attn.kv_a_proj_with_mqa.weight": (config.kv_lora_rank + 8, h2),
        "midlayer.self_attn.kv_a_layernorm.weight": (config.kv_lora_rank,),
        "midlayer.self_attn.kv_b_proj.weight": (nh * (16 + 16), config.kv_lora_rank),
        "midlayer.self_attn.o_proj.weight": (48, nh * 16),
    }


def test_mla_is_refused_where_it_cannot_be_built_or_served() -> None:
    llama = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 6,
             "num_key_value_heads": 2, "vocab_size": 80}  # fmt: skip
    with pytest.raises(TrainError, match=r"attention: mla needs a target with DeepSeek MLA dims.*'llama'"):
        drafter_config(llama, 24, [1, 3, 4], MLA)
    with pytest.raises(TrainError, match=r"\['head_dim'\]: not settable with attention: mla"):
        _tiny_mla(head_dim=64)
    with pytest.raises(DrafterConfigError, match="norm_before_fc with attention 'mla'"):
        _tiny_mla(norm_before_fc=True)
    with pytest.raises(TrainError, match="no q_lora_rank .* SGLang 0.5.23's Eagle3DeepseekV2ForCausalLM requires"):
        drafter_config(tiny_kimi_text_config(q_lora_rank=None), 24, [1, 3, 4], MLA)
    with pytest.raises(DrafterConfigError, match="an MLA head takes the DeepSeek YaRN or none"):
        _tiny_mla(rope_scaling={"rope_type": "linear", "factor": 2.0})
    config = _tiny_mla()
    assert config.to_dict()["attention"] == "mla"
    kept = tiny_kimi_text_config()["rope_scaling"] | {"rope_theta": 50000.0}  # as transformers 5 may write it
    assert drafter_config(tiny_kimi_text_config(rope_scaling=kept), 24, [1, 3, 4], MLA).rope_scaling == {
        k: v for k, v in kept.items() if k != "rope_theta"
    } | {"rope_type": "yarn"}
    assert "attention" not in drafter_config(tiny_kimi_text_config(), 24, [1, 3, 4], {}).to_dict()
