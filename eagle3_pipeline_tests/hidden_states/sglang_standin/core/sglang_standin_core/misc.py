"""Both releases' ``sampling.sampling_params.SamplingParams``, ``speculative.spec_info.SpeculativeAlgorithm``
and ``configs.model_config.ModelConfig``."""

from __future__ import annotations

from enum import Enum, auto
from typing import Any


class SamplingParams:
    def __init__(self, max_new_tokens: int = 128, temperature: float = 1.0, top_k: int = -1) -> None:
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k


class SpeculativeAlgorithm(Enum):
    EAGLE = auto()
    EAGLE3 = auto()
    NONE = auto()


class ModelConfig:
    def __init__(self, model_path: str, trust_remote_code: bool, dtype: str) -> None:
        from transformers import AutoConfig

        self.model_path = model_path
        self.trust_remote_code = trust_remote_code
        self.dtype = dtype
        self.hf_config: Any = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)

    @staticmethod
    def from_server_args(server_args: Any, model_path: str | None = None, **kwargs: Any) -> ModelConfig:
        return ModelConfig(model_path or server_args.model_path, server_args.trust_remote_code, server_args.dtype)
