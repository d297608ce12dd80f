"""Stand-in for ``sglang.srt.models.deepseek_v2`` (see the sglang package docstring)."""

from __future__ import annotations

from typing import Any

from sglang_standin_core.models import CausalLM, Decoder, deepseek_rule


class DeepseekV2Model(Decoder):
    def forward(self, input_ids: Any, positions: Any, forward_batch: Any) -> tuple[Any, list[Any]]:
        """0.5.14: the final norm's output and a list of the captured states."""
        hidden, states = self.captured(input_ids, positions, forward_batch)
        aux_hidden_states = []
        aux_hidden_states.extend(states)
        return hidden, aux_hidden_states


class DeepseekV2ForCausalLM(CausalLM):
    decoder_class = DeepseekV2Model

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        deepseek_rule(self, layer_ids)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
