"""Our export loads into SpecForge's own ``LlamaForCausalLMEagle3`` (``specforge==0.2.0``, whose
export names are ours), strictly, at toy size with matching logits and at Kimi-K2.5's
full size on the meta device.

SpecForge's model comes from the root conftest's ``specforge`` fixture, which loads it from the wheel
(:mod:`eagle3_pipeline_tests.drafter.specforge_wheel`).
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
import torch

F = torch.nn.functional

from eagle3_pipeline.drafter.export.specforge import export_for_servers, exported_tensors, server_config
from eagle3_pipeline.drafter.model.draft_config import drafter_config
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
from eagle3_pipeline.testing.drafter_reference import KIMI_AUX, kimi_k25_text_config, tiny_kimi_text_config

STEPS = 4


def _llama_config(export: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig.from_dict(export)


def test_a_tiny_kimi_like_export_loads_strictly_into_specforge_with_the_same_logits(
    specforge: types.ModuleType, tmp_path: Path
) -> None:
    target = tiny_kimi_text_config()
    config = drafter_config(target, 32, [1, 3, 4], {"head_dim": 16})  # 16 heads over 8 KV heads: GQA
    torch.manual_seed(0)
    model = Eagle3Drafter(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    used = torch.sort(torch.randperm(config.vocab_size)[: config.draft_vocab_size]).values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[used] = True
    model.set_vocab(used - torch.arange(config.draft_vocab_size), t2d)
    model.eval()
    folder = export_for_servers(model, tmp_path / "export", target, dtype="float32")

    from safetensors.torch import load_file

    exported = json.loads((folder / "config.json").read_text())
    assert exported["rope_scaling"]["rope_type"] == "yarn" and exported["vocab_size"] == target["vocab_size"]
    weights = load_file(str(folder / "model.safetensors"))
    assert "embed_tokens.weight" not in weights  # SpecForge loads the target's (Eagle3DraftModel.load_embedding)
    theirs = specforge.LlamaForCausalLMEagle3(_llama_config(exported)).eval()
    theirs.load_state_dict({**weights, "embed_tokens.weight": model.embed_tokens.weight.detach().clone()}, strict=True)
    assert torch.equal(theirs.midlayer.self_attn.rotary_emb.inv_freq, model.inv_freq)

    g = torch.Generator().manual_seed(1)
    b, t = 2, 12
    aux = torch.randn(b, t, 3 * config.target_hidden_size, generator=g)
    ids = torch.randint(0, config.vocab_size, (b, t), generator=g)
    with torch.no_grad():
        ours = model.ttt_forward(aux, ids, STEPS)
        # SpecForge's training-time test (OnlineEagle3Model): fc once, then per step the teacher-forced
        # token one further, the draft's own pre-norm hidden state, keys/values cached across steps.
        hidden = theirs.project_hidden_states(aux)
        mask = specforge.prepare_decoder_attention_mask(torch.ones(b, t, dtype=torch.bool), (b, t), hidden, 0)
        positions = torch.arange(t)[None]
        cache: list[list[torch.Tensor]] = [[], []]
        for j in range(STEPS):
            embeds = theirs.embed_input_ids(F.pad(ids[:, j + 1 :], (0, j + 1)))
            hidden = theirs.backbone(embeds, hidden, cache, mask, positions)
            torch.testing.assert_close(theirs.compute_logits(hidden), ours[j], rtol=1e-4, atol=1e-4)


def test_the_full_size_kimi_export_has_specforges_names_and_shapes(specforge: types.ModuleType) -> None:
    """Kimi-K2.5's drafter at full size (hidden 7168, vocab 163840, draft vocab 32000, YaRN ×64): the
    tensors our export writes are SpecForge's state dict less the embedding, which the servers and
    SpecForge take from the target; both models built on the meta device."""
    target = kimi_k25_text_config()
    config = drafter_config(target, 32000, KIMI_AUX, {})
    exported = server_config(config, target, "bfloat16")
    with torch.device("meta"):
        ours = exported_tensors(Eagle3Drafter(config))
        theirs = specforge.LlamaForCausalLMEagle3(_llama_config(exported)).state_dict()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {
        k: tuple(v.shape) for k, v in theirs.items() if k != "embed_tokens.weight"
    }
    assert tuple(theirs["embed_tokens.weight"].shape) == (target["vocab_size"], target["hidden_size"])
    assert tuple(ours["midlayer.self_attn.k_proj.weight"].shape) == (8 * 128, 2 * 7168) and tuple(
        ours["lm_head.weight"].shape
    ) == (32000, 7168)
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == KIMI_AUX and exported[
        "eagle_aux_hidden_state_layer_ids"
    ] == [2, 30, 58]
