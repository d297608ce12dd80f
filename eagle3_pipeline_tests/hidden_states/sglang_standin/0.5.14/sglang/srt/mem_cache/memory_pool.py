"""Stand-in for ``sglang.srt.mem_cache.memory_pool`` (see the sglang package docstring)."""

from sglang_standin_core.pools import ReqToTokenPool

__all__ = ["ReqToTokenPool"]
