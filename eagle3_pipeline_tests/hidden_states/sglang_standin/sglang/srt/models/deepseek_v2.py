"""Stand-in for ``sglang.srt.models.deepseek_v2`` (see the sglang package docstring)."""

from __future__ import annotations

from typing import Any

from sglang.srt.models._transformers import CausalLM, Decoder, run_requests


class DeepseekV2Model(Decoder):
    def __init__(self, stack: Any) -> None:
        super().__init__()
        self.stack = stack
        self.layers_to_capture: list[int] = []

    def forward(self, input_ids: Any, positions: Any, forward_batch: Any) -> tuple[Any, list[Any]]:
        return run_requests(self.stack, self.layers_to_capture, input_ids, positions, forward_batch)


class DeepseekV2ForCausalLM(CausalLM):
    decoder_class = DeepseekV2Model

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        """SGLang's DeepSeek rule: ``id + 1`` only when the first id is 1, the ids as written otherwise."""
        self.capture_aux_hidden_states = True
        if layer_ids is None:
            layers = self.config.num_hidden_layers
            self.model.layers_to_capture = [2, layers // 2, layers - 3]
        elif layer_ids and layer_ids[0] == 1:
            self.model.layers_to_capture = [i + 1 for i in layer_ids]
        else:
            self.model.layers_to_capture = list(layer_ids)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
