"""The request and token pools (both releases' ``mem_cache.memory_pool.ReqToTokenPool`` and
``mem_cache.allocator.base.BaseTokenToKVPoolAllocator``)."""

from __future__ import annotations


class ReqToTokenPool:
    """Request slots; a batch of more requests than free slots cannot be prepared."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.clear()

    def alloc(self, count: int) -> list[int]:
        if count > len(self.free_slots):
            raise RuntimeError(f"ReqToTokenPool: {count} requests, {len(self.free_slots)} free slots")
        taken, self.free_slots = self.free_slots[:count], self.free_slots[count:]
        return taken

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


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
