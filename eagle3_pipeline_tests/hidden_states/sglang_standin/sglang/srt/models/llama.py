"""Stand-in for ``sglang.srt.models.llama`` (see the sglang package docstring)."""

from __future__ import annotations

from typing import Any

from sglang.srt.models._transformers import CausalLM, Decoder, run_requests


class LlamaModel(Decoder):
    def __init__(self, stack: Any) -> None:
        super().__init__()
        self.stack = stack
        self.layers_to_capture: list[int] = []

    def forward(self, input_ids: Any, positions: Any, forward_batch: Any) -> tuple[Any, list[Any]]:
        return run_requests(self.stack, self.layers_to_capture, input_ids, positions, forward_batch)


class LlamaForCausalLM(CausalLM):
    decoder_class = LlamaModel

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        """SGLang's Llama rule: the input of layer ``id + 1`` (the output of layer ``id``) for every id."""
        self.capture_aux_hidden_states = True
        if layer_ids is None:
            layers = self.config.num_hidden_layers
            self.model.layers_to_capture = [2, layers // 2, layers - 3]
        else:
            self.model.layers_to_capture = [i + 1 for i in layer_ids]
