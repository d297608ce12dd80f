"""Stand-in for ``sglang.srt.models.kimi_k25`` (see the sglang package docstring)."""

from __future__ import annotations

from typing import Any

import torch

from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM


class KimiK25ForConditionalGeneration(torch.nn.Module):
    """The multimodal wrapper: its language model is SGLang's DeepSeek-V3 (the vision tower is not used)."""

    def __init__(self, language_model: Any) -> None:
        super().__init__()
        self.language_model = DeepseekV3ForCausalLM(language_model)

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        self.language_model.set_eagle3_layers_to_capture(layer_ids)

    def forward(self, input_ids: Any, positions: Any, forward_batch: Any) -> Any:
        return self.language_model(input_ids, positions, forward_batch)
