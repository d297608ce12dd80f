"""Configuration of the tiny Kimi-K2.5 stand-in checkpoint (remote code).

Copied into the checkpoint folder as ``configuration_kimi_k25.py`` and named by ``config.json``'s
``auto_map``. Like the real Kimi-K2.5 config, the outer config carries no model dimensions: they
all live in ``text_config``, a transformers :class:`~transformers.DeepseekV3Config` (MLA + MoE +
YaRN). The real config also holds a ``vision_config`` (MoonViT) and projector settings; this
stand-in has none, only ``media_placeholder_token_id`` and ``ignore_index``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25Config(PretrainedConfig):
    """``model_type: kimi_k25``: a DeepSeek-V3 language model config under ``text_config``."""

    model_type = "kimi_k25"
    # Declares text_config as a sub-config, so that settings such as ``attn_implementation``
    # reach the language model too.
    sub_configs_defaults: ClassVar[dict[str, Any]] = {"text_config": DeepseekV3Config}

    def __init__(
        self,
        text_config: dict[str, Any] | DeepseekV3Config | None = None,
        media_placeholder_token_id: int | None = None,
        ignore_index: int = -100,
        **kwargs: Any,
    ) -> None:
        if text_config is None:
            text_config = DeepseekV3Config()
        elif isinstance(text_config, dict):
            text_config = DeepseekV3Config(**{k: v for k, v in text_config.items() if k != "model_type"})
        self.text_config = text_config
        self.media_placeholder_token_id = media_placeholder_token_id
        self.ignore_index = ignore_index
        super().__init__(**kwargs)

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> DeepseekV3Config:
        """The language model's config (the only sub-model of this stand-in)."""
        return self.text_config
