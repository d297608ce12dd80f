"""Model class of the tiny Kimi-K2.5 stand-in checkpoint (remote code).

Copied into the checkpoint folder as ``modeling_kimi_k25.py`` and named by ``config.json``'s
``auto_map`` for ``AutoModel`` and ``AutoModelForCausalLM``. The real
``KimiK25ForConditionalGeneration`` is a vision-language wrapper (MoonViT vision tower, projector,
DeepSeek-V3 language model); this one holds only the language model, transformers' native
:class:`~transformers.DeepseekV3ForCausalLM`, under the same attribute, so the weight names are
the real ones: ``language_model.model.embed_tokens.weight``,
``language_model.model.layers.N.…`` (per-expert ``mlp.experts.E.{gate,up,down}_proj.weight`` in
the files, fused by transformers when loading), ``language_model.model.norm.weight`` and
``language_model.lm_head.weight``. Text in, logits out: ``forward`` hands everything to the
language model and returns its output.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from transformers import DeepseekV3ForCausalLM, GenerationMixin, PreTrainedModel

from .configuration_kimi_k25 import KimiK25Config


class KimiK25PreTrainedModel(PreTrainedModel):
    """Shared class attributes (the language model's prefix, its no-split decoder layer)."""

    config_class = KimiK25Config
    base_model_prefix = "language_model"
    supports_gradient_checkpointing = True
    _no_split_modules: ClassVar[list[str]] = ["DeepseekV3DecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True


class KimiK25ForConditionalGeneration(KimiK25PreTrainedModel, GenerationMixin):
    """Kimi-K2.5 without its vision tower: a DeepSeek-V3 causal LM as ``language_model``."""

    def __init__(self, config: KimiK25Config) -> None:
        super().__init__(config)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module | None:
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.language_model.set_output_embeddings(value)

    def get_decoder(self) -> nn.Module:
        return self.language_model.get_decoder()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        """The language model's forward (cache, ``output_hidden_states``, … pass through ``kwargs``)."""
        return self.language_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
