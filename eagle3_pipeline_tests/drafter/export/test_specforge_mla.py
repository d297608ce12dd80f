"""The MLA draft head's export: the config.json vLLM 0.32 and SGLang 0.5.23 read for
``Eagle3DeepseekV2ForCausalLM`` (Kimi-K2.5's dims), weights under the names both loaders take, a round
trip with identical logits, and the full-vocabulary export without ``d2t``/``t2d``.

SGLang has no engine here (no CPU build): ``SGLANG_PARAMETERS`` is SGLang 0.5.23's
``models/kimi_k25_eagle3.py`` read by hand (its ``load_weights`` maps ``layers.0.``/``midlayer.`` to
``model.midlayer.``, fuses ``q_a_proj`` + ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj_with_mqa`` over
2H inputs, stacks ``gate_proj``/``up_proj`` into ``gate_up_proj``, reads ``d2t`` as hot token ids, skips
``t2d``), a stand-in for the engine's own parameter table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
import torch
from safetensors.torch import load_file

from eagle3_pipeline.drafter.export.specforge import export_for_servers, load_export, server_config
from eagle3_pipeline.drafter.model.draft_config import DrafterConfig, drafter_config
from eagle3_pipeline.testing.drafter_reference import (
    KIMI_AUX,
    kimi_k25_text_config,
    tiny_drafter,
    tiny_drafter_inputs,
    tiny_kimi_text_config,
)


def sglang_parameters(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The parameters SGLang 0.5.23's ``Eagle3DeepseekV2ForCausalLM`` loads from a checkpoint (its
    ``embed_tokens`` comes from the target when the hidden sizes match), with their shapes."""
    h, nh, p = c.hidden_size, c.num_attention_heads, "model.midlayer."
    out = {
        "model.fc.weight": (h, 3 * c.target_hidden_size),
        "model.norm.weight": (h,),
        "lm_head.weight": (c.draft_vocab_size, h),
        p + "input_layernorm.weight": (h,),
        p + "hidden_norm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_up_proj.weight": (2 * c.intermediate_size, h),
        p + "mlp.down_proj.weight": (h, c.intermediate_size),
        p + "self_attn.fused_qkv_a_proj_with_mqa.weight": (c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim, 2 * h),
        p + "self_attn.q_a_layernorm.weight": (c.q_lora_rank,),
        p + "self_attn.q_b_proj.weight": (nh * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.q_lora_rank),
        p + "self_attn.kv_a_layernorm.weight": (c.kv_lora_rank,),
        p + "self_attn.kv_b_proj.weight": (nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        p + "self_attn.o_proj.weight": (h, nh * c.v_head_dim),
    }
    if c.fc_norm:
        out |= {f"model.fc_norm.{i}.weight": (c.target_hidden_size,) for i in range(3)}
    return out


def sglang_load(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """What SGLang's ``load_weights`` makes of the checkpoint's tensors: parameter name -> loaded shape."""
    loaded: dict[str, tuple[int, ...]] = {}
    a_proj: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in ("d2t", "t2d"):
            continue
        mapped = name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name
        mapped = mapped if mapped.startswith("lm_head.") else f"model.{mapped}"
        if ".gate_proj." in mapped or ".up_proj." in mapped:
            fused = mapped.replace(".gate_proj.", ".gate_up_proj.").replace(".up_proj.", ".gate_up_proj.")
            rows = loaded.get(fused, (0, tensor.shape[1]))[0] + tensor.shape[0]
            loaded[fused] = (rows, tensor.shape[1])
        elif "q_a_proj" in mapped or "kv_a_proj_with_mqa" in mapped:
            a_proj[mapped] = tensor
        else:
            loaded[mapped] = tuple(tensor.shape)
    q = next(n for n in a_proj if "q_a_proj" in n)
    fused = torch.cat([a_proj[q], a_proj[q.replace("q_a_proj", "kv_a_proj_with_mqa")]])
    loaded[q.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")] = tuple(fused.shape)
    return loaded


def _tiny_export(folder: Path, draft_vocab: int, **switches: Any) -> tuple[Path, Any]:
    target = tiny_kimi_text_config(hidden_size=48, intermediate_size=96)
    config = drafter_config(target, draft_vocab, [1, 3, 4], {"attention": "mla", **switches})
    model = tiny_drafter(config)
    if draft_vocab == config.vocab_size:
        model.set_vocab(torch.zeros(draft_vocab, dtype=torch.long), torch.ones(draft_vocab, dtype=torch.bool))
    model.embed_tokens.weight.data.normal_()
    return export_for_servers(model, folder, {**target, "text_config": target}, dtype="float32"), model


def test_kimi_config_json_names_the_mla_architecture_dims_and_layers() -> None:
    config = drafter_config(kimi_k25_text_config(), 32000, KIMI_AUX, {"attention": "mla", "fc_norm": True})
    out = server_config(config, kimi_k25_text_config(), "bfloat16")
    assert out["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert out["model_type"] == "deepseek_v2"  # vLLM turns a deepseek_v3 draft config into DeepSeekMTPModel
    expected = {
        "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64,
        "num_hidden_layers": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840, "draft_vocab_size": 32000,
        "tie_word_embeddings": False, "rope_theta": 50000.0, "max_position_embeddings": 262144, "fc_norm": True,
    }  # fmt: skip
    assert {k: out[k] for k in expected} == expected
    assert "head_dim" not in out and "norm_output" not in out
    assert out["rope_scaling"] == {"type": "yarn", "rope_type": "yarn", "factor": 64.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                   "original_max_position_embeddings": 4096}  # fmt: skip
    # target/layer_ids.py's DeepSeek rule: SGLang reads [1, 29, 57] as trained (it adds 1 only when the
    # first id is 1), vLLM the input-of-layer ids.
    assert out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert out["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]


@pytest.mark.parametrize("variant", [{}, {"fc_norm": True, "norm_output": True}])
def test_export_weights_load_as_sglangs_parameters_and_round_trip(tmp_path: Path, variant: dict) -> None:
    folder, model = _tiny_export(tmp_path / "mla", 24, **variant)
    tensors = load_file(str(folder / "model.safetensors"))
    assert set(tensors) >= {"d2t", "t2d", "midlayer.self_attn.kv_a_proj_with_mqa.weight"}
    assert "embed_tokens.weight" not in tensors
    assert sglang_load(tensors) == sglang_parameters(model.config)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["num_hidden_layers"] == 1 and raw["q_lora_rank"] > 0  # SGLang: exactly 1 layer, q_lora_rank
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": model.embed_tokens.weight.detach()}, str(target_dir / "model.safetensors"))
    (target_dir / "config.json").write_text(json.dumps(tiny_kimi_text_config(hidden_size=48)))
    loaded = load_export(folder, target_dir)
    assert loaded.config == model.config
    aux, ids = tiny_drafter_inputs(model.config, t=12)
    with torch.no_grad():
        for ours, theirs in zip(model.ttt_forward(aux, ids, 3), loaded.ttt_forward(aux, ids, 3), strict=True):
            torch.testing.assert_close(ours, theirs)


def test_full_vocabulary_export_carries_no_d2t(tmp_path: Path) -> None:
    """vLLM builds no draft_id_to_target_id for a full draft vocabulary and refuses a d2t weight."""
    folder, model = _tiny_export(tmp_path / "full", 128)
    tensors = load_file(str(folder / "model.safetensors"))
    assert "d2t" not in tensors and "t2d" not in tensors
    assert tensors["lm_head.weight"].shape == (128, 48)
    tensors["embed_tokens.weight"] = model.embed_tokens.weight.detach()
    from safetensors.torch import save_file

    save_file(tensors, str(folder / "model.safetensors"))
    loaded = load_export(folder)
    assert torch.equal(loaded.d2t, torch.zeros(128, dtype=torch.long)) and bool(loaded.t2d.all())
