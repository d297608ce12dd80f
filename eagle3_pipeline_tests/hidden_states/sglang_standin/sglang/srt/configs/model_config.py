"""Stand-in for ``sglang.srt.configs.model_config`` (see the sglang package docstring)."""

from __future__ import annotations

from typing import Any


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
