"""Stand-in for ``sglang.srt.configs.model_config`` (see the sglang package docstring)."""

from sglang_standin_core.misc import ModelConfig

__all__ = ["ModelConfig"]
