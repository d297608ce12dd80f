"""The draft model: chain drafting with a KV cache equals the unrolled TTT pass; export round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch

from eagle3_pipeline.drafter.export.specforge import export_for_servers, load_export
from eagle3_pipeline.drafter.model.draft_config import DrafterConfigError
from eagle3_pipeline.testing.drafter_reference import (
    chain_draft,
    tiny_drafter,
    tiny_drafter_config,
    tiny_drafter_inputs,
)

STEPS = 5


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
)
@pytest.mark.parametrize("variant", [{}, {"fc_norm": True, "norm_output": True}, {"norm_before_fc": True}])
def test_kv_cache_chain_drafting_equals_the_unrolled_ttt_pass(scaling: dict | None, variant: dict) -> None:
    """Also for the EAGLE-3.1 and norm_before_fc variants: training's pass drafts what a server's would."""
    config = tiny_drafter_config(rope_scaling=scaling, **variant)
    model = tiny_drafter(config)
    aux, ids = tiny_drafter_inputs(config)
    with torch.no_grad():
        unrolled = model.ttt_forward(aux, ids, STEPS)
        for t in range(0, ids.shape[1] - STEPS - 1):
            chained = chain_draft(model, aux, ids, t, STEPS)
            for j in range(STEPS):
                torch.testing.assert_close(chained[j], unrolled[j][:, t], rtol=1e-5, atol=1e-5)


def test_padding_does_not_change_the_real_positions() -> None:
    config = tiny_drafter_config()
    model = tiny_drafter(config)
    aux, ids = tiny_drafter_inputs(config, b=1, t=10)
    mask = torch.ones(1, 14, dtype=torch.bool)
    mask[:, 10:] = False
    padded_aux = torch.cat([aux, torch.randn(1, 4, aux.shape[-1])], dim=1)
    padded_ids = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain = model.ttt_forward(aux, ids, 3)
        padded = model.ttt_forward(padded_aux, padded_ids, 3, mask)
    for j in range(3):
        keep = 10 - j - 1  # indexes whose teacher-forced inputs are real tokens in both
        torch.testing.assert_close(padded[j][:, :keep], plain[j][:, :keep], rtol=1e-5, atol=1e-5)


def test_kept_indices_get_the_logits_of_the_full_pass() -> None:
    """Training asks for the draft head's logits only where the loss counts; they are the full pass's
    logits at those indices, in row-major order."""
    config = tiny_drafter_config()
    model = tiny_drafter(config)
    aux, ids = tiny_drafter_inputs(config)
    keep = [torch.rand(ids.shape, generator=torch.Generator().manual_seed(j)) < 0.4 for j in range(3)]
    with torch.no_grad():
        full = model.ttt_forward(aux, ids, 3)
        kept = model(aux, ids, 3, None, keep)
    for j in range(3):
        assert kept[j].shape == (int(keep[j].sum()), config.draft_vocab_size)
        torch.testing.assert_close(kept[j], full[j][keep[j]], rtol=1e-5, atol=1e-5)


def test_export_round_trip_gives_identical_logits(tmp_path: Path) -> None:
    config = tiny_drafter_config(aux_layer_ids=[1, 14, 26], max_position_embeddings=64)
    model = tiny_drafter(config)
    target_config = {"vocab_size": 80, "hidden_size": 48, "max_position_embeddings": 8192,
                     "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "eos_token_id": 2,
                     "num_attention_heads": 6, "intermediate_size": 96, "num_hidden_layers": 30}  # fmt: skip
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    from safetensors.torch import save_file

    save_file(
        {"model.embed_tokens.weight": model.embed_tokens.weight.detach().clone()}, str(target_dir / "model.safetensors")
    )
    (target_dir / "config.json").write_text(json.dumps(target_config))
    folder = export_for_servers(model, tmp_path / "export", target_config, dtype="float32")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["num_hidden_layers"] == 1
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert raw["max_position_embeddings"] == 8192 and raw["tie_word_embeddings"] is False
    assert "target_hidden_size" not in raw
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert "embed_tokens.weight" not in names and "inv_freq" not in " ".join(names)
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.mlp.down_proj.weight",
    } <= names
    reloaded = load_export(folder, target_model_dir=target_dir)
    aux, ids = tiny_drafter_inputs(config)
    with torch.no_grad():
        for a, b in zip(model.ttt_forward(aux, ids, 3), reloaded.ttt_forward(aux, ids, 3), strict=True):
            assert torch.equal(a, b)
    assert torch.equal(reloaded.d2t, model.d2t) and torch.equal(reloaded.t2d, model.t2d)


def test_bf16_export_carries_the_embedding_when_hidden_sizes_differ(tmp_path: Path) -> None:
    config = tiny_drafter_config(target_hidden_size=32)
    model = tiny_drafter(config)
    folder = export_for_servers(model, tmp_path / "export", {"vocab_size": 80, "hidden_size": 32})
    raw = json.loads((folder / "config.json").read_text())
    assert raw["target_hidden_size"] == 32 and raw["torch_dtype"] == "bfloat16"
    reloaded = load_export(folder)
    expected = {k: v.to(torch.bfloat16).float() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    for name, tensor in reloaded.state_dict().items():
        if name != "inv_freq":
            assert torch.equal(tensor, expected[name]), name


def test_export_without_embedding_needs_the_target_folder(tmp_path: Path) -> None:
    folder = export_for_servers(
        tiny_drafter(tiny_drafter_config()), tmp_path / "export", {"vocab_size": 80, "hidden_size": 48}
    )
    with pytest.raises(DrafterConfigError, match="target_model_dir"):
        load_export(folder)


def test_bad_configs_name_the_field() -> None:
    with pytest.raises(DrafterConfigError, match="num_key_value_heads"):
        tiny_drafter_config(num_key_value_heads=4)
    with pytest.raises(DrafterConfigError, match="rope_type 'dynamic'"):
        tiny_drafter_config(rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(DrafterConfigError, match="original_max_position_embeddings"):
        tiny_drafter_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
