"""Warm start of the MLA draft head (``drafter.model.attention: mla``): from this pipeline's own MLA
export trained on a tiny store (its weights loaded as exported, the start's τ the export's), from the
same weights as TorchSpec writes them (``deepseek_eagle.py``'s ``midlayer.*`` and its ``embed_tokens``
in a ``pytorch_model.bin``; the ``layers.0.*`` names SGLang's and vLLM's MLA loaders also take; a
config with only SGLang's ``eagle_config`` layer ids and YaRN's defaults left out), and each MLA dim,
RoPE value and the attention kind refused by file and field. Real files throughout; the training test
runs the train phase twice (slow tier, as test_warm_start.py's training test)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
import torch

from eagle3_pipeline.drafter.export.specforge import export_for_servers, load_export
from eagle3_pipeline.drafter.model.draft_config import DrafterConfig, drafter_config
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
from eagle3_pipeline.drafter.train.phase import run
from eagle3_pipeline.drafter.train.warm_start import WarmStartError, read_start
from eagle3_pipeline.testing.drafter_reference import tiny_drafter, tiny_drafter_config, tiny_kimi_text_config
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.train_settings import random_store_train_spec

MLA = {"attention": "mla"}
# Tiny MLA dims for the random target of random_store_train_spec (hidden 32, 4 heads).
TINY_MLA_TARGET = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "q_lora_rank": 16,
                   "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}  # fmt: skip


def _mla_spec(folder: Path, **settings: Any) -> dict[str, Any]:
    """A train spec over the random store, its target given MLA dims (a DeepSeek-V3-like config)."""
    spec = random_store_train_spec(folder, **settings)
    config_path = Path(spec["target_weights"]) / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **TINY_MLA_TARGET}))
    return spec


def _run_model(config: DrafterConfig, embedding: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> Eagle3Drafter:
    """A freshly built run drafter as the train phase builds it: seeded, the target's embedding, its vocabulary."""
    torch.manual_seed(5)
    model = Eagle3Drafter(config)
    model.set_target_embedding(embedding)
    model.set_vocab(d2t, t2d)
    return model


@pytest.mark.slow
def test_an_mla_export_trained_here_warm_starts_with_its_weights_and_its_tau(tmp_path: Path) -> None:
    first = _mla_spec(tmp_path / "a", epochs=1, export_dtype="float32", model=MLA)
    trained = run(first, Recorder())
    export = Path(first["export_dir"])
    assert json.loads((export / "config.json").read_text())["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    target = Path(first["target_weights"])
    exported = load_export(export, target)
    model = _run_model(exported.config, exported.embed_tokens.weight.detach(), exported.d2t, exported.t2d)
    warm = read_start(export, model)
    warm.apply(model)
    assert warm.format == "pipeline/torchspec (mla)" and warm.lm_head_rows == exported.config.draft_vocab_size
    theirs = exported.state_dict()
    assert all(torch.equal(value, theirs[name]) for name, value in model.state_dict().items())

    spec = _mla_spec(tmp_path / "a", epochs=1, export_dtype="float32", model=MLA, init_from=str(export))
    spec = {**spec, "run_dir": str(tmp_path / "warm" / "run"), "export_dir": str(tmp_path / "warm" / "export")}
    result = run(spec, Recorder())
    # A float32 export on the same eval split: the start's τ is the first run's last one.
    assert result["start"]["tau@3"] == pytest.approx(trained["evals"][-1]["tau@3"], abs=1e-4)
    assert result["start"]["format"] == "pipeline/torchspec (mla)"


def _tiny_mla(folder: Path, draft_vocab: int = 24) -> tuple[Eagle3Drafter, Path, dict[str, Any]]:
    """An MLA drafter on the tiny Kimi-like target (YaRN ×4, DeepSeek mscale pair), exported here."""
    target = tiny_kimi_text_config(hidden_size=48, intermediate_size=96)
    model = tiny_drafter(drafter_config(target, draft_vocab, [1, 3, 4], MLA))
    return model, export_for_servers(model, folder, target, dtype="float32"), target


def _torchspec_copy(ours: Path, folder: Path, layer_prefix: str, weights_file: str) -> Path:
    """Our MLA export rewritten as TorchSpec's ``configs/draft_models/kimi_*_eagle3_mla.json`` and its
    checkpoint are written: model_type kimi_k2, layer ids in ``eagle_config`` only, YaRN as ``type`` with
    beta_fast/beta_slow/truncate left to their defaults, the decoder layer under ``layer_prefix``, the
    draft's own ``embed_tokens`` saved."""
    from safetensors.torch import load_file, save_file

    raw = json.loads((ours / "config.json").read_text())
    for key in ("eagle3_pipeline", "eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "head_dim"):
        raw.pop(key, None)
    raw["model_type"] = "kimi_k2"
    left_out = ("rope_type", "beta_fast", "beta_slow", "truncate")
    raw["rope_scaling"] = {k: v for k, v in raw["rope_scaling"].items() if k not in left_out}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    tensors = {
        (layer_prefix + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v
        for k, v in load_file(str(ours / "model.safetensors")).items()
    }
    tensors["embed_tokens.weight"] = torch.randn(raw["vocab_size"], raw["hidden_size"])
    if weights_file == "pytorch_model.bin":
        torch.save(tensors, folder / weights_file)
    else:
        save_file(tensors, str(folder / weights_file))
    return folder


@pytest.mark.parametrize(
    ("prefix", "weights_file"), [("midlayer.", "pytorch_model.bin"), ("layers.0.", "model.safetensors")]
)
def test_a_torchspec_named_copy_loads_the_same_weights(tmp_path: Path, prefix: str, weights_file: str) -> None:
    start, ours, _ = _tiny_mla(tmp_path / "ours")
    folder = _torchspec_copy(ours, tmp_path / "torchspec", prefix, weights_file)
    assert "rope_type" not in json.loads((folder / "config.json").read_text())["rope_scaling"]
    embedding = torch.randn(start.config.vocab_size, 48)
    loaded = {}
    for source in (ours, folder):
        model = _run_model(start.config, embedding, start.d2t, start.t2d)
        read_start(source, model).apply(model)
        loaded[source] = model.state_dict()
    assert all(torch.equal(loaded[folder][k], v) for k, v in loaded[ours].items())
    name = "midlayer.self_attn.kv_a_proj_with_mqa.weight"
    assert torch.equal(loaded[folder][name], start.state_dict()[name])
    assert torch.equal(loaded[folder]["embed_tokens.weight"], embedding)  # the run's (target's), not the start's


def _edit(folder: Path, **changes: Any) -> None:
    raw = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"q_lora_rank": 8}, "q_lora_rank is 8, this run's is 32 (the target's q_lora_rank"),
        ({"kv_lora_rank": 8}, "kv_lora_rank is 8, this run's is 16"),
        ({"qk_nope_head_dim": 8}, "qk_nope_head_dim is 8, this run's is 16"),
        ({"qk_rope_head_dim": 4}, "qk_rope_head_dim is 4, this run's is 8"),
        ({"v_head_dim": 8}, "v_head_dim is 8, this run's is 16"),
        ({"num_attention_heads": 2, "num_key_value_heads": 2}, "num_attention_heads is 2, this run's is 4"),
        ({"rope_theta": 10000.0}, "rope_theta is 10000.0, this run's is 50000.0 (the target's RoPE"),
        ({"rope_scaling": None}, "rope_scaling.rope_type is default, this run's is yarn"),
        ({"fc_norm": True}, "fc_norm is True, this run's is False (drafter.model.fc_norm)"),
        ({"q_lora_rank": None}, "['q_lora_rank'] must be numbers"),
        (
            {"eagle_aux_hidden_state_layer_ids": None, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}},
            "eagle_config.eagle_aux_hidden_state_layer_ids [2, 4, 5] without vLLM's top-level ids",
        ),
    ],
)
def test_an_mla_start_that_is_not_the_runs_head_is_refused_by_file_and_field(
    tmp_path: Path, changes: dict[str, Any], field: str
) -> None:
    start, folder, _ = _tiny_mla(tmp_path / "start")
    _edit(folder, **changes)
    model = _run_model(start.config, torch.randn(128, 48), start.d2t, start.t2d)
    with pytest.raises(WarmStartError) as refused:
        read_start(folder, model)
    assert str(folder / "config.json") in str(refused.value) and field in str(refused.value)


@pytest.mark.parametrize("key", ["factor", "mscale_all_dim", "original_max_position_embeddings"])
def test_each_yarn_value_of_the_start_is_compared(tmp_path: Path, key: str) -> None:
    start, folder, _ = _tiny_mla(tmp_path / "start")
    scaling = dict(json.loads((folder / "config.json").read_text())["rope_scaling"])
    scaling[key] = 2 * scaling[key] + 1
    _edit(folder, rope_scaling=scaling)
    model = _run_model(start.config, torch.randn(128, 48), start.d2t, start.t2d)
    with pytest.raises(WarmStartError, match=rf"rope_scaling\.{key} is {float(scaling[key])}, this run's is"):
        read_start(folder, model)


def test_an_mla_start_for_a_gqa_run_and_the_reverse_are_refused_naming_both(tmp_path: Path) -> None:
    mla, mla_folder, target = _tiny_mla(tmp_path / "mla")
    gqa_config = drafter_config(target, 24, [1, 3, 4], {})
    gqa = tiny_drafter(gqa_config)
    gqa_folder = export_for_servers(gqa, tmp_path / "gqa", target, dtype="float32")
    embedding = torch.randn(128, 48)
    with pytest.raises(WarmStartError) as refused:
        read_start(mla_folder, _run_model(gqa_config, embedding, gqa.d2t, gqa.t2d))
    assert str(refused.value).startswith(str(mla_folder / "config.json")) and (
        "the start is an MLA (Eagle3DeepseekV2ForCausalLM) draft head, this run trains a GQA (Llama-style, "
        "LlamaForCausalLMEagle3) one (drafter.model.attention: gqa); set drafter.model.attention: mla"
    ) in str(refused.value)
    with pytest.raises(WarmStartError) as refused:
        read_start(gqa_folder, _run_model(mla.config, embedding, mla.d2t, mla.t2d))
    assert "the start is a GQA (Llama-style, LlamaForCausalLMEagle3) draft head, this run trains an MLA" in str(
        refused.value
    ) and "(drafter.model.attention: mla)" in str(refused.value)


def test_a_llama_start_with_equal_yarn_written_otherwise_is_accepted(tmp_path: Path) -> None:
    """The RoPE check compares values, not spellings: YaRN's defaults left out read as written."""
    scaling = {"rope_type": "yarn", "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0}  # fmt: skip
    start = tiny_drafter(tiny_drafter_config(rope_scaling=scaling))
    target = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 80,
        "hidden_size": 48,
        "max_position_embeddings": 128,
    }
    folder = export_for_servers(start, tmp_path / "start", target, dtype="float32")
    _edit(folder, rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 64})
    model = _run_model(start.config, torch.randn(80, 48), start.d2t, start.t2d)
    read_start(folder, model).apply(model)
    assert torch.equal(model.fc.weight, start.fc.weight)
