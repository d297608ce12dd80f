"""Stand-in for ``sglang.srt.mem_cache.unified_cache.component_type`` (see the sglang package docstring)."""

from __future__ import annotations

from enum import Enum


class ComponentType(int, Enum):
    FULL = 0
    SWA = 1
    MAMBA = 2
