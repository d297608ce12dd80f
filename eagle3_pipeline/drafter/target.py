"""What the drafter needs from the target model folder: its config, input embedding and lm_head.

Only the two tensors are read (``safe_open`` on the one file that holds each, found through
``model.safetensors.index.json`` for sharded checkpoints), never the whole target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_EMBEDDING_KEY = "model.embed_tokens.weight"
DEFAULT_LM_HEAD_KEY = "lm_head.weight"


class TargetWeightsError(ValueError):
    """The target folder lacks the config or a tensor the drafter needs."""


@dataclass
class TargetWeights:
    config: dict[str, Any]
    embedding: torch.Tensor
    lm_head: torch.Tensor

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])


def read_target_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise TargetWeightsError(f"{path}: no target config.json (drafter.target_weights must be the target model folder)")
    raw: dict[str, Any] = json.loads(path.read_text())
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size", "num_hidden_layers"):
        if key not in raw:
            raise TargetWeightsError(f"{path}: field {key!r} is missing")
    return raw


def _file_holding(folder: Path, key: str) -> Path:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        if key not in weight_map:
            raise TargetWeightsError(f"{index}: no tensor {key!r} in weight_map")
        return folder / weight_map[key]
    single = folder / "model.safetensors"
    if not single.is_file():
        raise TargetWeightsError(f"{folder}: neither model.safetensors nor model.safetensors.index.json")
    return single


def read_tensor(folder: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    path = _file_holding(Path(folder), key)
    with safe_open(str(path), framework="pt") as handle:
        if key not in handle.keys():
            raise TargetWeightsError(f"{path}: no tensor {key!r}")
        return handle.get_tensor(key)


def load_target_weights(folder: Path, embedding_key: str = DEFAULT_EMBEDDING_KEY, lm_head_key: str | None = None) -> TargetWeights:
    """``lm_head_key`` None: ``lm_head.weight``, or the embedding when the target ties them."""
    config = read_target_config(folder)
    embedding = read_tensor(folder, embedding_key)
    if lm_head_key is None and config.get("tie_word_embeddings", False):
        lm_head = embedding
    else:
        lm_head = read_tensor(folder, lm_head_key or DEFAULT_LM_HEAD_KEY)
    expected = (int(config["vocab_size"]), int(config["hidden_size"]))
    for name, tensor in (("embedding", embedding), ("lm_head", lm_head)):
        if tuple(tensor.shape) != expected:
            raise TargetWeightsError(f"{folder}: target {name} has shape {tuple(tensor.shape)}, expected {expected} (vocab_size, hidden_size)")
    return TargetWeights(config, embedding, lm_head)
