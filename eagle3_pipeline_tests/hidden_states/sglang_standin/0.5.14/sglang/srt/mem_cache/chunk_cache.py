"""Stand-in for ``sglang.srt.mem_cache.chunk_cache``: the prefix cache SGLang uses with the radix
cache off (no prefix is ever matched)."""

from __future__ import annotations

from typing import Any


class ChunkCache:
    def __init__(self, params: Any) -> None:
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size

    def match_prefix(self, token_ids: Any) -> list[int]:
        return []
