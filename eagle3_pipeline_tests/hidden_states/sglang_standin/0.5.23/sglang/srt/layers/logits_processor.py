"""Stand-in for ``sglang.srt.layers.logits_processor`` (see the sglang package docstring)."""

from sglang_standin_core.logits import LogitsProcessor, LogitsProcessorOutput

__all__ = ["LogitsProcessor", "LogitsProcessorOutput"]
