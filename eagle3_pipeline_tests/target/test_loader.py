"""The one target loader (`eagle3_pipeline.target.folder`) on checkpoints shaped like the real ones: a nested
`text_config`, `language_model.`-prefixed sharded weights, remote code, INT4, too large to run.

The checkpoints here are written directly (config.json, an index and safetensors shards of the
right names and shapes), so each test controls exactly the property it is about; the whole Kimi-like
fixture (remote code, tokenizer, template) is exercised in `eagle3_pipeline_tests/kimi/`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_pipeline.target.folder import (
    TargetError,
    check_local_executable,
    check_remote_code,
    checkpoint_bytes,
    dimensions,
    drafter_tensor_names,
    read_config,
    read_tensors,
    weight_prefix,
)

pytest.importorskip("torch")
import torch

HIDDEN, VOCAB = 64, 512
TEXT_CONFIG = {
    "model_type": "deepseek_v3",
    "hidden_size": HIDDEN,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "kv_lora_rank": 16,
    "vocab_size": VOCAB,
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096},
}
KIMI_CONFIG = {
    "model_type": "kimi_k25",
    "architectures": ["KimiK25ForConditionalGeneration"],
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
    "text_config": TEXT_CONFIG,
}


def write_checkpoint(folder: Path, config: dict, shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    """A sharded safetensors checkpoint: ``shards`` maps file name → its tensors."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    weight_map, total = {}, 0
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file))
        for name, tensor in tensors.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return folder


def kimi_like(folder: Path, expert_shards: int = 2, expert_numel: int = 1024) -> Path:
    g = torch.Generator().manual_seed(0)
    experts = {
        f"model-{i + 3:05d}.safetensors": {
            f"language_model.model.layers.{i}.mlp.experts.0.down_proj.weight": torch.randn(
                expert_numel, generator=g
            ).to(torch.bfloat16)
        }
        for i in range(expert_shards)
    }
    return write_checkpoint(
        folder,
        KIMI_CONFIG,
        {
            "model-00001.safetensors": {
                "language_model.model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16)
            },
            "model-00002.safetensors": {
                "language_model.lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16),
                "language_model.model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            },
            **experts,
        },
    )


def test_nested_text_config_gives_the_language_models_dimensions(tmp_path: Path) -> None:
    raw = read_config(str(kimi_like(tmp_path / "kimi")))
    dims = dimensions(raw)
    assert (dims.num_layers, dims.hidden_size, dims.vocab_size, dims.model_type, dims.mla) == (
        8,
        HIDDEN,
        VOCAB,
        "deepseek_v3",
        True,
    )
    assert dims.max_position_embeddings == 262144
    with pytest.raises(TargetError, match=r"\(text_config\): field 'num_hidden_layers' is missing"):
        dimensions({**KIMI_CONFIG, "text_config": {k: v for k, v in TEXT_CONFIG.items() if k != "num_hidden_layers"}})


def test_prefix_detected_and_tensors_read_by_name(tmp_path: Path) -> None:
    folder = kimi_like(tmp_path / "kimi")
    assert weight_prefix(folder) == "language_model."
    names = drafter_tensor_names(folder)
    assert (names.embedding, names.lm_head, names.norm) == (
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
        "language_model.model.norm.weight",
    )
    tensors = read_tensors(folder, [names.embedding, names.lm_head, names.norm])
    assert tensors[names.embedding].shape == (VOCAB, HIDDEN) and tensors[names.norm].shape == (HIDDEN,)
    with pytest.raises(TargetError, match="no tensor 'lm_head.weight' in weight_map"):
        read_tensors(folder, ["lm_head.weight"])


def test_reading_two_tensors_opens_only_their_shards(tmp_path: Path) -> None:
    """A shard the reader does not need may be corrupt: it is never opened."""
    folder = kimi_like(tmp_path / "kimi")
    (folder / "model-00003.safetensors").write_bytes(b"not a safetensors file")
    names = drafter_tensor_names(folder)
    assert set(read_tensors(folder, [names.embedding, names.lm_head])) == {names.embedding, names.lm_head}


PEAK_RSS = """
import json, sys
from pathlib import Path
import torch, safetensors.torch
from eagle3_pipeline.target.weights import load_target_weights
def peak_kib():  # VmHWM: this process's own peak (ru_maxrss would carry the forking parent's over exec)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])
before = peak_kib()
if sys.argv[2] == "ours":
    weights = load_target_weights(sys.argv[1])
    shapes = [list(t.float().shape) for t in (weights.embedding, weights.lm_head)]
else:  # the control: every tensor of every shard read, as loading the model does
    shapes = [[float(t.float().sum()) for t in safetensors.torch.load_file(str(f)).values()]
              for f in sorted(Path(sys.argv[1]).glob("*.safetensors"))]
after = peak_kib()
print(json.dumps({"before_kib": before, "after_kib": after, "shapes": shapes}))
"""


def _peak_rss_growth(folder: Path, mode: str) -> tuple[int, int, list]:
    out = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, str(folder), mode], capture_output=True, text=True, check=True
    )
    measured = json.loads(out.stdout)
    return measured["before_kib"] * 1024, measured["after_kib"] * 1024, measured["shapes"]


@pytest.mark.slow
def test_peak_rss_reading_the_drafters_tensors_is_far_below_the_checkpoint(tmp_path: Path) -> None:
    """Peak RSS of a fresh process that reads embed_tokens + lm_head from a 400 MB sharded checkpoint
    (4 expert shards of 100 MB the reader must not touch) grows by about those two tensors; the
    same process reading every shard (the control) grows by about the checkpoint."""
    folder = kimi_like(tmp_path / "big", expert_shards=4, expert_numel=50_000_000)
    total = checkpoint_bytes(folder)
    before, after, shapes = _peak_rss_growth(folder, "ours")
    control_before, control_after, _ = _peak_rss_growth(folder, "all")
    print(
        f"checkpoint {total / 1e6:.1f} MB; reading embed_tokens + lm_head ({2 * VOCAB * HIDDEN * 2 / 1e6:.3f} "
        f"MB): peak RSS {before / 1e6:.1f} -> {after / 1e6:.1f} MB; reading every shard: "
        f"{control_before / 1e6:.1f} -> {control_after / 1e6:.1f} MB"
    )
    assert shapes == [[VOCAB, HIDDEN], [VOCAB, HIDDEN]]
    assert total > 400e6 and after - before < 0.05 * total
    assert control_after - control_before > 0.5 * total


def test_remote_code_without_trust_names_the_setting(tmp_path: Path) -> None:
    raw = read_config(str(kimi_like(tmp_path / "kimi")))
    with pytest.raises(TargetError, match=r"ships its own code .* set target\.trust_remote_code: true"):
        check_remote_code("kimi", raw, trust_remote_code=False)
    check_remote_code("kimi", raw, trust_remote_code=True)
    check_remote_code("llama", {"model_type": "llama"}, trust_remote_code=False)


def test_int4_and_too_large_checkpoints_are_refused_before_loading(tmp_path: Path) -> None:
    folder = kimi_like(tmp_path / "kimi")
    raw = read_config(str(folder))
    int4 = {**raw, "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}}
    with pytest.raises(
        TargetError, match=r"quantized \(compressed-tensors\).*cannot execute quantized weights.*SGLang.*vLLM"
    ):
        check_local_executable(str(folder), int4, "cpu", 4, 10**12)
    with pytest.raises(TargetError, match=r"more than the 0\.0 GB this machine can give it.*serving stack"):
        check_local_executable(str(folder), raw, "cpu", 4, 1000)
    check_local_executable(str(folder), raw, "cpu", 4, 10**12)
