"""Stand-in for ``sglang.srt.speculative.spec_info`` (see the sglang package docstring)."""

from sglang_standin_core.misc import SpeculativeAlgorithm

__all__ = ["SpeculativeAlgorithm"]
