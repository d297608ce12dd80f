"""Stand-in for ``sglang.srt.mem_cache.cache_init_params`` (see the sglang package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CacheInitParams:
    disable: bool
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    page_size: int
