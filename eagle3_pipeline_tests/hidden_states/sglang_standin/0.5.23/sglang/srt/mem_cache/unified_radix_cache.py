"""Stand-in for ``sglang.srt.mem_cache.unified_radix_cache``: with ``disable`` it is the prefix
cache SGLang uses with the radix cache off (no prefix is ever matched)."""

from __future__ import annotations

from typing import Any


class UnifiedRadixCache:
    def __init__(self, params: Any) -> None:
        if params.tree_components is None:
            raise AssertionError("UnifiedRadixCache: params.tree_components is None")
        if not params.disable:
            raise RuntimeError("stand-in UnifiedRadixCache: only the disabled cache (radix cache off)")
        if not isinstance(params.page_size, int):
            raise TypeError(f"UnifiedRadixCache: page_size {params.page_size!r} (a raw ServerArgs field?)")
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.disable = params.disable

    def match_prefix(self, token_ids: Any) -> list[int]:
        return []
