"""Stand-in for ``sglang.srt.mem_cache.allocator.base`` (see the sglang package docstring)."""

from sglang_standin_core.pools import BaseTokenToKVPoolAllocator

__all__ = ["BaseTokenToKVPoolAllocator"]
