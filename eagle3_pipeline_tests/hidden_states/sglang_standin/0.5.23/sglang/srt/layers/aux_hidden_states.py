"""Stand-in for ``sglang.srt.layers.aux_hidden_states`` (see the sglang package docstring)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class AuxHiddenStatePacker:
    """The K captures of a forward written side by side into one [N, K·H] tensor."""

    def __init__(self, num_captures: int) -> None:
        self._num_captures = num_captures
        self._parts: list[Any] = []

    def extend(self, hiddens: Iterable[Any]) -> None:
        self._parts.extend(hiddens)

    def __len__(self) -> int:
        return len(self._parts)

    def finalize(self) -> Any:
        import torch

        if len(self._parts) != self._num_captures:
            raise RuntimeError(f"captured {len(self._parts)} of {self._num_captures} aux hidden states")
        return torch.cat(self._parts, dim=-1)
