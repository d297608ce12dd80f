"""Each drafter variant's export strict-loads in vLLM 0.32's own EAGLE-3 class (``Eagle3LlamaForCausalLM``,
built on the CPU from the export's config.json with the embedded model as the target, no engine started):
every parameter but the embedding (the target's, shared when serving) comes from the export, vLLM reads
the variant switches the trainer used, and its step-0 input (``combine_hidden_states``: ``input_norm``,
``fc_norm``, ``fc``) equals the trainer's :meth:`Eagle3Drafter.combine` on the same aux states.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.drafter.draft_config import drafter_config  # noqa: E402
from eagle3_pipeline.drafter.export import export_for_servers, load_export  # noqa: E402
from eagle3_pipeline.drafter.model import Eagle3Drafter  # noqa: E402
from eagle3_pipeline.testing import vllm_eagle3_load  # noqa: E402
from eagle3_pipeline.testing.kimi.fixture import build_kimi_text_checkpoint  # noqa: E402

VARIANTS = {
    "eagle3": {},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "norm_before_fc": {"norm_before_fc": True, "norm_output": True},
}
DRAFT_VOCAB = 64


def _export(local_model: Path, folder: Path, switches: dict[str, bool]) -> Path:
    target = json.loads((local_model / "config.json").read_text())
    config = drafter_config(target, DRAFT_VOCAB, [1, 14, 26], switches)
    torch.manual_seed(0)
    model = Eagle3Drafter(config)
    with torch.no_grad():
        for param in model.parameters():  # norms off 1 too, so a norm vLLM skipped would show
            param.normal_(1.0 if param.dim() == 1 else 0.0, 0.2)
    model.set_vocab(torch.arange(DRAFT_VOCAB) * 3, torch.arange(config.vocab_size) % 3 == 0)
    return export_for_servers(model, folder, target, dtype="float32")


def test_each_variants_export_strict_loads_in_vllms_class_and_combines_as_trained(
    real_vllm_python: Path, local_model: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    exports = [_export(local_model, tmp_path / name, switches) for name, switches in VARIANTS.items()]
    aux = torch.randn(5, 3 * 576, generator=torch.Generator().manual_seed(1)) * 4
    save_file({"aux": aux}, str(tmp_path / "aux.safetensors"))
    done = subprocess.run(
        [str(real_vllm_python), vllm_eagle3_load.__file__, str(local_model), str(tmp_path), *map(str, exports)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "result.json").read_text())
    for i, ((name, switches), result) in enumerate(zip(VARIANTS.items(), results, strict=True)):
        assert result["not_loaded"] == ["model.embed_tokens.weight"], name
        for key in ("fc_norm", "norm_output", "norm_before_fc"):
            assert result[key] == switches.get(key, False), (name, key)
        assert ("model.fc_norm.2.weight" in result["parameters"]) == switches.get("fc_norm", False)
        assert ("model.input_norm.weight" in result["parameters"]) == switches.get("norm_before_fc", False)
        ours = load_export(exports[i], local_model)
        served = load_file(str(tmp_path / f"combined-{i}.safetensors"))["combined"]
        with torch.no_grad():
            torch.testing.assert_close(served, ours.combine(aux), rtol=1e-4, atol=1e-4)


# The MLA head (drafter.model.attention: mla) on the Kimi-K2.5 stand-in: pruned vocabulary, and EAGLE-3.1
# with the full vocabulary (no d2t, which vLLM refuses then).
MLA_VARIANTS = {
    "mla": ({}, DRAFT_VOCAB),
    "mla-eagle3.1-full-vocab": ({"fc_norm": True, "norm_output": True}, None),
}


def test_mla_head_export_strict_loads_in_vllms_deepseek_eagle3_class(real_vllm_python: Path, tmp_path: Path) -> None:
    """vLLM 0.32's ``Eagle3DeepseekV2ForCausalLM`` built for the Kimi-K2.5 stand-in's language model
    (``build_kimi_text_checkpoint``: a DeepSeek-V3 checkpoint, since vLLM's CPU build cannot build the
    stand-in's multimodal class) loads every weight of the MLA export (fusing q_a/kv_a into
    ``fused_qkv_a_proj``), reads the EAGLE-3.1 switches, and computes what the trainer does where it can be
    compared without an engine: the step-0 input, the DeepSeek YaRN cos/sin cache (interleaved RoPE over
    qk_rope_head_dim) and the softmax scale."""
    from safetensors.torch import load_file, save_file

    target_dir = build_kimi_text_checkpoint(tmp_path / "kimi-text")
    text = json.loads((target_dir / "config.json").read_text())
    models, exports = [], []
    for name, (switches, vocab) in MLA_VARIANTS.items():
        config = drafter_config(text, vocab or text["vocab_size"], [1, 3, 5], {"attention": "mla", **switches})
        torch.manual_seed(0)
        model = Eagle3Drafter(config)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(1.0 if param.dim() == 1 else 0.0, 0.2)
        if vocab:
            model.set_vocab(torch.arange(vocab) * 3, torch.arange(config.vocab_size) % 3 == 0)
        else:
            model.set_vocab(
                torch.zeros(config.vocab_size, dtype=torch.long), torch.ones(config.vocab_size, dtype=torch.bool)
            )
        models.append(model)
        exports.append(export_for_servers(model, tmp_path / name, text, dtype="float32"))
    aux = torch.randn(5, 3 * text["hidden_size"], generator=torch.Generator().manual_seed(1)) * 4
    save_file({"aux": aux}, str(tmp_path / "aux.safetensors"))
    done = subprocess.run(
        [str(real_vllm_python), vllm_eagle3_load.__file__, str(target_dir), str(tmp_path), *map(str, exports)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "result.json").read_text())
    for i, (name, model, result) in enumerate(zip(MLA_VARIANTS, models, results, strict=True)):
        c = model.config
        assert result["class"] == "Eagle3DeepseekV2ForCausalLM", name
        assert result["not_loaded"] == ["model.embed_tokens.weight"], name
        assert (result["fc_norm"], result["norm_output"]) == (c.fc_norm, c.norm_output), name
        assert ("draft_id_to_target_id" in result["parameters"]) == (c.draft_vocab_size != c.vocab_size), name
        assert result["shapes"]["model.layers.0.self_attn.fused_qkv_a_proj.weight"] == [
            c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim,
            2 * c.hidden_size,
        ]
        assert (result["rope_class"], result["rope_neox"]) == ("DeepseekScalingRotaryEmbedding", False)
        assert result["softmax_scale"] == pytest.approx(model.midlayer.self_attn.scale, rel=1e-6)
        served_rope = load_file(str(tmp_path / f"rope-{i}.safetensors"))["cos_sin"]
        cos, sin = model.rope(torch.arange(served_rope.shape[0]))
        half = c.qk_rope_head_dim // 2
        torch.testing.assert_close(served_rope, torch.cat([cos[:, :half], sin[:, :half]], -1), rtol=1e-6, atol=1e-6)
        served = load_file(str(tmp_path / f"combined-{i}.safetensors"))["combined"]
        with torch.no_grad():
            torch.testing.assert_close(served, model.combine(aux), rtol=1e-4, atol=1e-4)
