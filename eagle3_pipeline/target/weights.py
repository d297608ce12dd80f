"""What the drafter (and the teacher's check against the served model) needs from the target model
folder: its language model's config, input embedding and ``lm_head``.

Read through :mod:`eagle3_pipeline.target.folder`: the config resolved to the language model (Kimi-K2.5's
nested ``text_config``), the tensor names under the prefix the checkpoint's index shows
(``language_model.`` for Kimi-K2.5), and only the shards that hold those two tensors opened. torch is
imported only by the readers, so this module stays light for the layers below the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_pipeline.target.folder import (
    TargetError,
    dimensions,
    drafter_tensor_names,
    read_config,
    read_tensors,
    text_config,
)

if TYPE_CHECKING:
    import torch


class TargetWeightsError(TargetError):
    """The target folder lacks the config or a tensor the drafter needs."""


@dataclass
class TargetWeights:
    config: dict[str, Any]  # the language model's config (nested text_config resolved)
    embedding: torch.Tensor
    lm_head: torch.Tensor

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])


def read_target_config(folder: Path) -> dict[str, Any]:
    """The language model's config of the target folder, its dimensions checked."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise TargetWeightsError(
            f"{path}: no target config.json (drafter.target_weights must be the target model folder)"
        )
    raw = read_config(str(folder))
    dimensions(raw, str(path))
    return text_config(raw)


def embedding_tensor(folder: Path, embedding_key: str | None = None) -> torch.Tensor:
    """The target's input embedding (the name detected under the checkpoint's prefix unless set)."""
    name = drafter_tensor_names(Path(folder), embedding_key).embedding
    return read_tensors(Path(folder), [name])[name]


def load_target_weights(
    folder: Path, embedding_key: str | None = None, lm_head_key: str | None = None
) -> TargetWeights:
    """``embedding_key``/``lm_head_key`` None: the names under the detected prefix; ``lm_head`` is
    the embedding when the target ties them and ships no ``lm_head``."""
    folder = Path(folder)
    config = read_target_config(folder)
    names = drafter_tensor_names(folder, embedding_key, lm_head_key)
    tensors = read_tensors(folder, [names.embedding, names.lm_head])
    embedding, lm_head = tensors[names.embedding], tensors[names.lm_head]
    expected = (int(config["vocab_size"]), int(config["hidden_size"]))
    for name, tensor in (("embedding", embedding), ("lm_head", lm_head)):
        if tuple(tensor.shape) != expected:
            raise TargetWeightsError(
                f"{folder}: target {name} has shape {tuple(tensor.shape)}, expected "
                f"{expected} (vocab_size, hidden_size)"
            )
    return TargetWeights(config, embedding, lm_head)
