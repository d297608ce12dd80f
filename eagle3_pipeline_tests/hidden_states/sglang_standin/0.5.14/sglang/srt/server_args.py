"""Stand-in for ``sglang.srt.server_args`` (see the sglang package docstring)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerArgs:
    model_path: str
    trust_remote_code: bool = False
    dtype: str = "auto"
    tp_size: int = 1
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    disable_radix_cache: bool = False
    chunked_prefill_size: int | None = None
    disable_cuda_graph: bool = False
    ep_size: int = 1
    page_size: int = 1
    device: str = "cpu"
