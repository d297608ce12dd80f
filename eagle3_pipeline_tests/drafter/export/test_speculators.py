"""Conversion of our export to the vLLM speculators layout, and back into our model class with
identical logits. The fields asserted are those vLLM's speculators adapter reads
(``transformers_utils/configs/speculators/algos.py``:
``speculators_model_type``, ``transformer_layer_config``, the first proposal method's
``speculative_tokens``, ``verifier.name_or_path``, ``norm_before_residual``, the layer ids)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch

from eagle3_pipeline.drafter.export.specforge import export_for_servers, load_export
from eagle3_pipeline.drafter.export.speculators import to_speculators
from eagle3_pipeline.drafter.model.draft_config import DrafterConfigError
from eagle3_pipeline.testing.drafter_reference import tiny_drafter, tiny_drafter_config, tiny_drafter_inputs


def _target(folder: Path, embedding: torch.Tensor) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 80, "hidden_size": 48,
              "max_position_embeddings": 8192, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
              "num_attention_heads": 6, "intermediate_size": 96, "num_hidden_layers": 30}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": embedding}, str(folder / "model.safetensors"))
    return folder


def test_speculators_conversion_round_trips_with_identical_logits(tmp_path: Path) -> None:
    config = tiny_drafter_config(aux_layer_ids=[1, 14, 26])
    model = tiny_drafter(config)
    target = _target(tmp_path / "target", model.embed_tokens.weight.detach().clone())
    export = export_for_servers(
        model, tmp_path / "export", json.loads((target / "config.json").read_text()), dtype="float32"
    )
    out = to_speculators(export, tmp_path / "speculators", target, verifier="org/target-model", speculative_tokens=5)

    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["architectures"] == ["Eagle3Speculator"]
    assert raw["norm_before_residual"] is False and raw["draft_vocab_size"] == 24 and raw["target_hidden_size"] == 48
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM uses them as-is (input of layer)
    layer = raw["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 80 and layer["tie_word_embeddings"] is False
    spec = raw["speculators_config"]
    assert spec["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 5}
    assert spec["verifier"] == {"name_or_path": "org/target-model", "architectures": ["LlamaForCausalLM"]}
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {
        "embed_tokens.weight",
        "fc.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.hidden_norm.weight",
        "d2t",
        "t2d",
    } <= names
    assert not any(name.startswith("midlayer.") for name in names)

    reloaded = load_export(out)
    aux, ids = tiny_drafter_inputs(config)
    with torch.no_grad():
        for a, b in zip(model.ttt_forward(aux, ids, 3), reloaded.ttt_forward(aux, ids, 3), strict=True):
            assert torch.equal(a, b)
    assert reloaded.config.aux_layer_ids == [1, 14, 26]


def test_a_speculators_drafter_with_norm_before_residual_is_refused(tmp_path: Path) -> None:
    model = tiny_drafter(tiny_drafter_config())
    target = _target(tmp_path / "target", model.embed_tokens.weight.detach().clone())
    out = to_speculators(
        export_for_servers(model, tmp_path / "export", {"vocab_size": 80, "hidden_size": 48}), tmp_path / "sp", target
    )
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "norm_before_residual": True}))
    with pytest.raises(DrafterConfigError, match="norm_before_residual"):
        load_export(out)


def test_a_variant_export_is_not_converted_to_the_speculators_layout(tmp_path: Path) -> None:
    """The speculators layout would drop the EAGLE-3.1 switches: serving it would not be what was trained."""
    model = tiny_drafter(tiny_drafter_config(fc_norm=True, norm_output=True))
    target = _target(tmp_path / "target", model.embed_tokens.weight.detach().clone())
    export = export_for_servers(model, tmp_path / "export", {"vocab_size": 80, "hidden_size": 48})
    with pytest.raises(DrafterConfigError, match="fc_norm, norm_output on; the speculators layout"):
        to_speculators(export, tmp_path / "sp", target)
