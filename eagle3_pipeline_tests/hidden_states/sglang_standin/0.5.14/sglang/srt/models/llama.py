"""Stand-in for ``sglang.srt.models.llama`` (see the sglang package docstring)."""

from __future__ import annotations

from typing import Any

from sglang_standin_core.models import CausalLM, Decoder, llama_rule


class LlamaModel(Decoder):
    def forward(self, input_ids: Any, positions: Any, forward_batch: Any) -> tuple[Any, list[Any]]:
        """The final norm's output and a list of the captured states."""
        hidden, states = self.captured(input_ids, positions, forward_batch)
        aux_hidden_states = []
        aux_hidden_states.extend(states)
        return hidden, aux_hidden_states


class LlamaForCausalLM(CausalLM):
    decoder_class = LlamaModel

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        llama_rule(self, layer_ids)
