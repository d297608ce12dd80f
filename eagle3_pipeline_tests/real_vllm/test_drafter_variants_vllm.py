"""Each drafter variant's export strict-loads in vLLM 0.32's own EAGLE-3 class, built on the CPU from the
export's config.json, no engine started (one vLLM process loads them all): every parameter but the
embedding (the target's, shared when serving) comes from the export, vLLM reads the variant switches the
trainer used, and its step-0 input (``combine_hidden_states``: ``input_norm``, ``fc_norm``, ``fc``) equals
the trainer's :meth:`Eagle3Drafter.combine` on the same aux states. The Llama variants load in
``Eagle3LlamaForCausalLM`` with the embedded model as the target; the MLA head in
``Eagle3DeepseekV2ForCausalLM`` with the Kimi-K2.5 stand-in's language model as the target
(``build_kimi_text_checkpoint``: a DeepSeek-V3 checkpoint, since vLLM's CPU build cannot build the
stand-in's multimodal class), where vLLM's RoPE cache and softmax scale are compared too.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.drafter.export.specforge import export_for_servers, load_export  # noqa: E402
from eagle3_pipeline.drafter.model.draft_config import drafter_config  # noqa: E402
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter  # noqa: E402
from eagle3_pipeline.testing import vllm_eagle3_load  # noqa: E402
from eagle3_pipeline.testing.kimi.fixture import build_kimi_text_checkpoint  # noqa: E402

VARIANTS = {
    "eagle3": {},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "norm_before_fc": {"norm_before_fc": True, "norm_output": True},
}
# The MLA head (drafter.model.attention: mla): pruned vocabulary, and EAGLE-3.1 with the full vocabulary
# (no d2t, which vLLM refuses then).
MLA_VARIANTS = {
    "mla": ({}, True),
    "mla-eagle3.1-full-vocab": ({"fc_norm": True, "norm_output": True}, False),
}
DRAFT_VOCAB = 64


def _drafter(target: dict[str, Any], aux_ids: list[int], switches: dict[str, Any], pruned: bool) -> Eagle3Drafter:
    config = drafter_config(target, DRAFT_VOCAB if pruned else int(target["vocab_size"]), aux_ids, switches)
    torch.manual_seed(0)
    model = Eagle3Drafter(config)
    with torch.no_grad():
        for param in model.parameters():  # norms off 1 too, so a norm vLLM skipped would show
            param.normal_(1.0 if param.dim() == 1 else 0.0, 0.2)
    v = config.vocab_size
    if pruned:
        model.set_vocab(torch.arange(DRAFT_VOCAB) * 3, torch.arange(v) % 3 == 0)
    else:
        model.set_vocab(torch.zeros(v, dtype=torch.long), torch.ones(v, dtype=torch.bool))
    return model


@dataclass
class Loaded:
    folder: Path
    results: list[dict[str, Any]]
    exports: list[Path]
    models: list[Eagle3Drafter]
    aux: dict[str, Any]  # the aux states vLLM combined (torch tensors)


@pytest.fixture(scope="module")
def loaded(real_vllm_python: Path, local_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("vllm-load")
    llama_target = json.loads((local_model / "config.json").read_text())
    kimi_dir = build_kimi_text_checkpoint(folder / "kimi-text")
    kimi_target = json.loads((kimi_dir / "config.json").read_text())
    models = [_drafter(llama_target, [1, 14, 26], switches, True) for switches in VARIANTS.values()]
    models += [_drafter(kimi_target, [1, 3, 5], {"attention": "mla", **s}, p) for s, p in MLA_VARIANTS.values()]
    names = [*VARIANTS, *MLA_VARIANTS]
    targets = [llama_target] * len(VARIANTS) + [kimi_target] * len(MLA_VARIANTS)
    exports = [
        export_for_servers(model, folder / name, target, dtype="float32")
        for name, model, target in zip(names, models, targets, strict=True)
    ]
    generator = torch.Generator().manual_seed(1)
    aux = {"aux": torch.randn(5, 3 * 576, generator=generator) * 4}
    aux |= {f"aux-{i}": torch.randn(5, 3 * 64, generator=generator) * 4 for i in range(len(VARIANTS), len(names))}
    save_file(aux, str(folder / "aux.safetensors"))
    specs = [str(e) if i < len(VARIANTS) else f"{e}::{kimi_dir}" for i, e in enumerate(exports)]
    done = subprocess.run(
        [str(real_vllm_python), vllm_eagle3_load.__file__, str(local_model), str(folder), *specs],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return Loaded(folder, json.loads((folder / "result.json").read_text()), exports, models, aux)


def test_each_variants_export_strict_loads_in_vllms_class_and_combines_as_trained(
    loaded: Loaded, local_model: Path
) -> None:
    from safetensors.torch import load_file

    for i, (name, switches) in enumerate(VARIANTS.items()):
        result = loaded.results[i]
        assert result["class"] == "Eagle3LlamaForCausalLM", name
        assert result["not_loaded"] == ["model.embed_tokens.weight"], name
        for key in ("fc_norm", "norm_output", "norm_before_fc"):
            assert result[key] == switches.get(key, False), (name, key)
        assert ("model.fc_norm.2.weight" in result["parameters"]) == switches.get("fc_norm", False)
        assert ("model.input_norm.weight" in result["parameters"]) == switches.get("norm_before_fc", False)
        ours = load_export(loaded.exports[i], local_model)
        served = load_file(str(loaded.folder / f"combined-{i}.safetensors"))["combined"]
        with torch.no_grad():
            torch.testing.assert_close(served, ours.combine(loaded.aux["aux"]), rtol=1e-4, atol=1e-4)


def test_mla_head_export_strict_loads_in_vllms_deepseek_eagle3_class(loaded: Loaded) -> None:
    """Every MLA weight loads (q_a/kv_a fused into ``fused_qkv_a_proj``), the EAGLE-3.1 switches are read,
    and vLLM's DeepSeek YaRN cos/sin cache (interleaved RoPE over qk_rope_head_dim), softmax scale and
    step-0 input equal the trainer's."""
    from safetensors.torch import load_file

    for i, name in enumerate(MLA_VARIANTS, start=len(VARIANTS)):
        model, result = loaded.models[i], loaded.results[i]
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
        served_rope = load_file(str(loaded.folder / f"rope-{i}.safetensors"))["cos_sin"]
        cos, sin = model.rope(torch.arange(served_rope.shape[0]))
        half = c.qk_rope_head_dim // 2
        torch.testing.assert_close(served_rope, torch.cat([cos[:, :half], sin[:, :half]], -1), rtol=1e-6, atol=1e-6)
        served = load_file(str(loaded.folder / f"combined-{i}.safetensors"))["combined"]
        with torch.no_grad():
            torch.testing.assert_close(served, model.combine(loaded.aux[f"aux-{i}"]), rtol=1e-4, atol=1e-4)
