"""Stand-in for ``sglang.srt.speculative.spec_info`` (see the sglang package docstring)."""

from __future__ import annotations

from enum import Enum, auto


class SpeculativeAlgorithm(Enum):
    EAGLE = auto()
    EAGLE3 = auto()
    NONE = auto()
