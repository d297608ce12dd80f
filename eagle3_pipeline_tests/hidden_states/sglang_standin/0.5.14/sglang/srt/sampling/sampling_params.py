"""Stand-in for ``sglang.srt.sampling.sampling_params`` (see the sglang package docstring)."""

from sglang_standin_core.misc import SamplingParams

__all__ = ["SamplingParams"]
