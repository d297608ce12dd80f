"""The drafter's YaRN RoPE and its shape for a Kimi-K2.5 target.

YaRN is checked against transformers' DeepSeek-V3 (the target's own implementation: its rotary
embedding's ``inv_freq``/``attention_scaling`` and ``DeepseekV3Attention.scaling``) over every position
up to 262144, and the exported config.json against transformers' Llama reading it (the reader SGLang
and vLLM load a Llama drafter's config through). Target configs are plain dicts of the language model,
as :mod:`eagle3_pipeline.target.folder` gives them: the checkpoint's ``text_config`` (legacy
``rope_theta``/``rope_scaling``) or a transformers-5 ``DeepseekV3Config`` dict (``rope_parameters``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("torch")
import torch

from eagle3_pipeline.drafter.export.specforge import server_config
from eagle3_pipeline.drafter.model.draft_config import DrafterConfig, DrafterConfigError, drafter_config
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter, rope_attention_factor, rope_inverse_frequencies
from eagle3_pipeline.drafter.spec import TrainError
from eagle3_pipeline.testing.drafter_reference import (
    KIMI_AUX,
    KIMI_ROPE,
    kimi_k25_text_config,
    tiny_kimi_text_config,
)
from eagle3_pipeline.testing.drafter_reference import (
    KIMI_POSITIONS as POSITIONS,
)


def _deepseek_v3(text: dict[str, Any]) -> Any:
    from transformers import DeepseekV3Config

    keys = set(DeepseekV3Config().to_dict()) | {"rope_theta", "rope_scaling"}  # the legacy keys it converts
    kwargs: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in text.items() if k in keys}
    return DeepseekV3Config(**kwargs)


def _drafter(text: dict[str, Any], **overrides: Any) -> DrafterConfig:
    return drafter_config(
        text,
        32000 if text["vocab_size"] > 32000 else 32,
        KIMI_AUX if text["num_hidden_layers"] == 61 else [1, 3, 4],
        overrides,
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def test_yarn_matches_transformers_deepseek_v3_at_every_position_up_to_262144() -> None:
    """The drafter's YaRN over the target's rotary dimension (qk_rope_head_dim 64) against
    transformers' DeepSeek-V3: the same inverse frequencies, so the same cos/sin angles at every
    position, and the same factor on q·k. DeepSeek-V3 puts ``yarn_get_mscale(64, mscale_all_dim)²``
    into its softmax scale and ``mscale/mscale_all_dim`` (1) into cos/sin; the drafter, as the
    servers serve a Llama drafter, puts ``0.1·ln 64 + 1`` into cos/sin: both multiply q·k by 2.0047."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    text = kimi_k25_text_config()
    target = _deepseek_v3(text)
    rotary = DeepseekV3RotaryEmbedding(target)
    with torch.device("meta"):
        attention = DeepseekV3Attention(target, layer_idx=0)
    ours = DrafterConfig(**{**_drafter(text).to_dict(), "head_dim": target.qk_rope_head_dim,
                            "num_attention_heads": 1, "num_key_value_heads": 1, "hidden_size": 16,
                            "target_hidden_size": 16, "intermediate_size": 16, "vocab_size": 64,
                            "draft_vocab_size": 8})  # fmt: skip
    assert torch.equal(rope_inverse_frequencies(ours), rotary.inv_freq)  # largest difference 0: bitwise equal

    positions = torch.arange(POSITIONS)
    with torch.no_grad():
        cos, sin = Eagle3Drafter(ours).rope(positions)
        target_cos, target_sin = (t[0] for t in rotary(torch.zeros(1, 1, 1), positions[None]))
    ours_factor, target_factor = rope_attention_factor(ours), float(rotary.attention_scaling)
    assert target_factor == 1.0 and ours_factor == pytest.approx(0.1 * math.log(64) + 1, abs=1e-15)
    # The angles are the same float32 products, so cos/sin differ only by the factor each side applies.
    assert (cos - target_cos * ours_factor / target_factor).abs().max().item() < 2e-7
    assert (sin - target_sin * ours_factor / target_factor).abs().max().item() < 2e-7

    # What multiplies q·k besides 1/sqrt(head_dim): ours m², DeepSeek-V3 attention_scaling² · mscale_all_dim².
    target_qk = target_factor**2 * attention.scaling * math.sqrt(target.qk_head_dim)
    assert abs(ours_factor**2 - target_qk) < 1e-12 and target_qk == pytest.approx(2.0047397, abs=1e-7)

    # Attention logits of the rotary part, query at p and key at p - d, over the whole context.
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4096, target.qk_rope_head_dim, generator=g).unbind(0)
    query_at = torch.randint(0, POSITIONS, (4096,), generator=g)
    key_at = (query_at - torch.randint(0, POSITIONS, (4096,), generator=g)).clamp(min=0)
    logits = (_rotate(q, cos[query_at], sin[query_at]) * _rotate(k, cos[key_at], sin[key_at])).sum(-1)
    target_logits = (
        _rotate(q, target_cos[query_at], target_sin[query_at]) * _rotate(k, target_cos[key_at], target_sin[key_at])
    ).sum(-1) * (attention.scaling * math.sqrt(target.qk_head_dim))
    assert ((logits - target_logits).abs() / target_logits.abs().clamp(min=1.0)).max().item() < 1e-5


def test_the_exported_yarn_is_read_back_as_trained_by_transformers_llama() -> None:
    """The served config.json (head_dim 128, as the drafter trains) through transformers' Llama rotary
    embedding: the same inverse frequencies and attention factor (mscale 1 / mscale_all_dim 0 is the
    pair every reader maps to 0.1·ln(factor) + 1), so the same cos/sin at every position."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _drafter(kimi_k25_text_config())
    served = server_config(config, kimi_k25_text_config(), "bfloat16")
    assert served["rope_scaling"] == {
        "rope_type": "yarn", "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
    }  # fmt: skip
    assert (
        served["rope_theta"] == 50000.0 and served["max_position_embeddings"] == POSITIONS and served["head_dim"] == 128
    )
    rotary = LlamaRotaryEmbedding(LlamaConfig.from_dict(served))
    assert torch.equal(rotary.inv_freq, rope_inverse_frequencies(config))
    assert rotary.attention_scaling == rope_attention_factor(config)
    positions = torch.arange(0, POSITIONS, 7)
    tiny = DrafterConfig(**{**config.to_dict(), "hidden_size": 16, "target_hidden_size": 16, "intermediate_size": 16,
                            "num_attention_heads": 1, "num_key_value_heads": 1, "vocab_size": 64,
                            "draft_vocab_size": 8})  # fmt: skip
    with torch.no_grad():
        cos, sin = Eagle3Drafter(tiny).rope(positions)
        llama_cos, llama_sin = (t[0] for t in rotary(torch.zeros(1, 1, 1), positions[None]))
    assert torch.equal(cos, llama_cos) and torch.equal(sin, llama_sin)


def test_a_kimi_target_gets_the_published_deepseek_v3_drafter_shape_and_the_targets_rope() -> None:
    legacy = _drafter(kimi_k25_text_config())
    transformers_5 = _drafter(_deepseek_v3(kimi_k25_text_config()).to_dict())
    assert legacy == transformers_5
    assert (legacy.hidden_size, legacy.num_attention_heads, legacy.num_key_value_heads, legacy.head_dim) == (
        7168,
        56,
        8,
        128,
    )
    assert (legacy.intermediate_size, legacy.vocab_size, legacy.draft_vocab_size) == (40960, 163840, 32000)
    assert legacy.rope_theta == 50000.0 and legacy.max_position_embeddings == POSITIONS and legacy.rms_norm_eps == 1e-6
    assert (
        legacy.rope_scaling is not None
        and legacy.rope_scaling["factor"] == 64.0
        and legacy.rope_scaling["mscale_all_dim"] == 0.0
    )
    tiny = _drafter(tiny_kimi_text_config())
    assert (tiny.num_attention_heads, tiny.num_key_value_heads, tiny.head_dim, tiny.intermediate_size) == (
        2,
        2,
        128,
        1536,
    )
    small_heads = _drafter(tiny_kimi_text_config(), head_dim=16)
    assert (small_heads.num_attention_heads, small_heads.num_key_value_heads) == (16, 8)
    # Not MLA: the target's own attention shape, as before.
    llama = drafter_config(
        {
            **tiny_kimi_text_config(),
            "model_type": "llama",
            "kv_lora_rank": None,
            "num_key_value_heads": 2,
            "head_dim": 64,
        },
        32,
        [1, 3, 4],
        {},
    )
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim, llama.intermediate_size) == (
        4,
        2,
        64,
        512,
    )


def test_drafter_model_overrides_replace_the_targets_rope_and_shape() -> None:
    text = kimi_k25_text_config()
    no_scaling = _drafter(text, rope_scaling=None, rope_theta=1e6, num_key_value_heads=4, intermediate_size=18432)
    assert no_scaling.rope_scaling is None and no_scaling.rope_theta == 1e6
    assert (no_scaling.num_key_value_heads, no_scaling.intermediate_size, no_scaling.num_attention_heads) == (
        4,
        18432,
        56,
    )
    assert (
        _drafter(text, rope_scaling={"rope_type": "default"}).rope_scaling is None
    )  # what `rope_scaling: null` reaches the phase as
    other = _drafter(
        text,
        rope_scaling={"rope_type": "yarn", "factor": 32, "original_max_position_embeddings": 8192},
        max_position_embeddings=524288,
    )
    assert other.rope_scaling == {"rope_type": "yarn", "type": "yarn", "factor": 32.0,
                                  "original_max_position_embeddings": 8192, "beta_fast": 32, "beta_slow": 1,
                                  "mscale": 1.0, "mscale_all_dim": 0.0}  # fmt: skip
    assert other.max_position_embeddings == 524288
    with pytest.raises(
        TrainError, match=r"drafter.model.max_position_embeddings 131072: expected at least the target's 262144"
    ):
        _drafter(text, max_position_embeddings=131072)
    with pytest.raises(
        DrafterConfigError, match=r"drafter.model.rope_scaling: \['attn_factor'\] are read by some servers"
    ):
        _drafter(text, rope_scaling={**KIMI_ROPE, "attn_factor": 1.2})
    with pytest.raises(DrafterConfigError, match=r"target config rope_scaling.mscale 0.707"):
        _drafter(kimi_k25_text_config(rope_scaling={**KIMI_ROPE, "mscale": 0.707}))
    with pytest.raises(
        DrafterConfigError, match=r"rope_scaling.mscale_all_dim 1.0: servers read mscale/mscale_all_dim differently"
    ):
        DrafterConfig(**{**_drafter(text).to_dict(), "rope_scaling": dict(KIMI_ROPE)})


def test_drafter_model_rope_settings_reach_the_train_spec() -> None:
    """`drafter.model.rope_scaling: null` survives the spec's `exclude_defaults` dump as the scaling that means none."""
    from eagle3_pipeline.config import DrafterModelConfig, load_config
    from eagle3_pipeline.drafter.spec import train_spec

    pipeline = load_config(None, runtime_checks=False)
    model = DrafterModelConfig.model_validate(
        {"rope_scaling": None, "rope_theta": 1e6, "max_position_embeddings": 300000}
    )
    pipeline = pipeline.model_copy(
        update={"drafter": pipeline.drafter.model_copy(update={"target_weights": "/models/kimi", "model": model})}
    )
    overrides = train_spec(pipeline)["settings"]["model"]
    config = _drafter(kimi_k25_text_config(), **overrides)
    assert config.rope_scaling is None and config.rope_theta == 1e6 and config.max_position_embeddings == 300000
    assert DrafterModelConfig().model_dump(exclude_defaults=True) == {}
