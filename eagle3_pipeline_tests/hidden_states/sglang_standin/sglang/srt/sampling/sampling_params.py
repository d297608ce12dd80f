"""Stand-in for ``sglang.srt.sampling.sampling_params`` (see the sglang package docstring)."""

from __future__ import annotations


class SamplingParams:
    def __init__(self, max_new_tokens: int = 128, temperature: float = 1.0, top_k: int = -1) -> None:
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
