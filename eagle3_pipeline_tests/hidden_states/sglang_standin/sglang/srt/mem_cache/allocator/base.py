"""Stand-in for ``sglang.srt.mem_cache.allocator.base`` (see the sglang package docstring)."""

from __future__ import annotations


class BaseTokenToKVPoolAllocator:
    """KV slots for tokens; a batch of more tokens than free slots cannot be prepared."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.clear()

    def alloc(self, count: int) -> range:
        if count > self.free:
            raise RuntimeError(f"token pool: {count} tokens, {self.free} free slots")
        start = self.size - self.free
        self.free -= count
        return range(start, start + count)

    def clear(self) -> None:
        self.free = self.size
