"""Weights per GPU from a checkpoint folder (real safetensors headers written here, an index, config.json alone),
the quantization formats, TP's split and replication rules; the training-memory fit against the embedded draft's
measured figures; rolling_window_shards auto as extracted."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from eagle3_pipeline.config import load_config
from eagle3_pipeline.fit.checkpoint import CheckpointError, quantization_of, read_weights
from eagle3_pipeline.fit.report import train_memory
from eagle3_pipeline.fit.runtime import resolved
from eagle3_pipeline.hidden_states.resume import RESULT_FILE
from eagle3_pipeline.hidden_states.sharding import ROLLING_LAYOUT_FILE

TINY = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "torch_dtype": "float32",
}  # fmt: skip
LOCAL = Path(__file__).parents[2] / "eagle3_pipeline" / "profiles" / "local.yaml"


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A real safetensors file: header, then zeroed data of the declared sizes."""
    size = {"F32": 4, "BF16": 2, "I32": 4, "F8_E4M3": 1}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        count = 1
        for dim in shape:
            count *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + count * size[dtype]]}
        offset += count * size[dtype]
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def tiny_tensors() -> dict[str, tuple[str, list[int]]]:
    tensors: dict[str, tuple[str, list[int]]] = {
        "model.embed_tokens.weight": ("F32", [1000, 64]),
        "lm_head.weight": ("F32", [1000, 64]),
        "model.norm.weight": ("F32", [64]),
    }
    for layer in range(2):
        base = f"model.layers.{layer}."
        tensors |= {
            base + "self_attn.q_proj.weight": ("F32", [64, 64]),
            base + "self_attn.k_proj.weight": ("F32", [16, 64]),
            base + "self_attn.v_proj.weight": ("F32", [16, 64]),
            base + "self_attn.o_proj.weight": ("F32", [64, 64]),
            base + "mlp.gate_proj.weight": ("F32", [128, 64]),
            base + "mlp.up_proj.weight": ("F32", [128, 64]),
            base + "mlp.down_proj.weight": ("F32", [64, 128]),
            base + "input_layernorm.weight": ("F32", [64]),
            base + "post_attention_layernorm.weight": ("F32", [64]),
        }
    return tensors


def test_headers_give_exact_bytes_and_the_split(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    write_safetensors(tmp_path / "model.safetensors", tiny_tensors())
    weights = read_weights(tmp_path)
    params = sum(a * (b if len(s) > 1 else 1) for _, s in tiny_tensors().values() for a, b in [(s[0], s[-1])])
    assert weights.basis == "headers" and weights.total_bytes == params * 4
    served = weights.per_gpu_bytes(1)
    assert served == params * 2, "float32 is served as bfloat16"
    kv = 2 * 2 * 16 * 64 * 2  # k and v of 2 layers, bf16
    norms = (64 + 2 * 2 * 64) * 2
    # TP 4: 2 KV heads cannot split 4 ways, each rank keeps one head (half of k/v); norms replicated
    split = (served - kv - norms) / 4 + kv / 2 + norms
    assert weights.per_gpu_bytes(4) == pytest.approx(split)


def test_an_index_scales_the_config_shapes_to_its_total_size(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "torch_dtype": "bfloat16"}))
    names = {name: "model-00001-of-00001.safetensors" for name in tiny_tensors()}
    names["model.layers.2.self_attn.q_proj.weight"] = names["lm_head.weight"]  # an MTP-style extra layer
    total = sum(2 * (s[0] * (s[-1] if len(s) > 1 else 1)) for _, s in tiny_tensors().values())
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total + 64 * 64 * 2}, "weight_map": names})
    )
    weights = read_weights(tmp_path)
    assert weights.basis == "index"
    assert weights.scale == pytest.approx(1.0, abs=0.01)
    assert weights.per_gpu_bytes(1) == pytest.approx(total, rel=0.01), "layer 2 ≥ num_hidden_layers is not loaded"


def test_quantization_formats() -> None:
    fp8 = quantization_of(
        {"hidden_size": 1, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    )
    assert fp8.bytes_per_param == pytest.approx(1 + 4 / 16384)
    int4 = quantization_of(
        {
            "hidden_size": 1,
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "group_size": 32}}},
                "ignore": ["lm_head", "re:.*self_attn.*"],
            },
        }
    )
    assert int4.bytes_per_param == pytest.approx(0.5 + 2 / 32)
    assert int4.applies("model.layers.3.mlp.experts.7.up_proj")
    assert not int4.applies("model.layers.3.self_attn.q_a_proj") and not int4.applies("lm_head")
    awq = quantization_of(
        {"hidden_size": 1, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    )
    assert awq.bytes_per_param == pytest.approx(0.5 + 2.5 / 128)
    nvfp4 = quantization_of(
        {"hidden_size": 1, "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
    )
    assert nvfp4.bytes_per_param == pytest.approx(0.5 + 1 / 16)
    with pytest.raises(CheckpointError, match="quant_method 'bitsandbytes'"):
        quantization_of({"hidden_size": 1, "quantization_config": {"quant_method": "bitsandbytes"}})


def test_a_folder_without_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config.json: missing"):
        read_weights(tmp_path)


# benchmarks/drafter_train.py --memory on the embedded draft (docs/measurements.md "The resource model against
# real figures"): KiB per token of a step, slope between 512 and 2048 tokens, mean of two runs,
# (activation_checkpointing, ttt_steps) → measured.
MEASURED_KIB_PER_TOKEN = {(False, 3): 170.4, (False, 7): 352.2, (True, 3): 110.9, (True, 7): 143.5}


@pytest.mark.parametrize(("checkpointing", "steps"), list(MEASURED_KIB_PER_TOKEN))
def test_training_memory_fit_matches_the_embedded_measurements(checkpointing: bool, steps: int) -> None:
    config = load_config(LOCAL, runtime_checks=False)
    config = config.model_copy(update={"drafter": config.drafter.model_copy(update={"ttt_steps": steps})})
    raw = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000,
        "tie_word_embeddings": True,
    }  # fmt: skip  (SmolLM2-135M-Instruct's config.json)
    slope = (
        (train_memory(config, raw, checkpointing, 2048) - train_memory(config, raw, checkpointing, 512)) / 1536 / 1024
    )
    assert slope == pytest.approx(MEASURED_KIB_PER_TOKEN[(checkpointing, steps)], rel=0.12)


def test_rolling_auto_follows_the_store_once_extracted(tmp_path: Path) -> None:
    config = load_config(LOCAL, runtime_checks=False)
    config = config.model_copy(
        update={
            "artifacts_root": tmp_path,
            "hidden_states": config.hidden_states.model_copy(update={"rolling_window_shards": "auto"}),
        }
    )
    assert resolved(config, "unknown").hidden_states.rolling_window_shards is None
    store = tmp_path / "hidden_states"
    store.mkdir()
    (store / RESULT_FILE).write_text("{}")
    assert resolved(config, "unknown").hidden_states.rolling_window_shards is None, "a whole store: off"
    (store / ROLLING_LAYOUT_FILE).write_text(
        json.dumps({"window_shards": 12, "windows": [], "eval_shards": [], "rows": []})
    )
    assert resolved(config, "unknown").hidden_states.rolling_window_shards == 12, "the store's own window"
