"""The stand-in's models, backed by transformers (not an SGLang module; see the sglang package
docstring): a causal LM whose decoder runs each request of a packed batch alone and catches the
residual stream entering the layers in ``layers_to_capture``."""

from __future__ import annotations

from typing import Any

import torch

from sglang.srt.layers.logits_processor import LogitsProcessor


def _entering(caught: dict[int, Any], index: int) -> Any:
    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        caught[index] = args[0] if args else kwargs["hidden_states"]

    return hook


def run_requests(
    stack: Any, layers_to_capture: list[int], input_ids: Any, positions: Any, forward_batch: Any
) -> tuple[Any, list[Any]]:
    """The final norm's output [N, H] and, per captured layer, its input [N, H]; N = the packed tokens."""
    finals: list[Any] = []
    captured: list[list[Any]] = [[] for _ in layers_to_capture]
    start = 0
    for length in forward_batch.extend_seq_lens:
        ids = input_ids[start : start + length].unsqueeze(0)
        caught: dict[int, Any] = {}
        handles = [
            stack.layers[k].register_forward_pre_hook(_entering(caught, k), with_kwargs=True) for k in layers_to_capture
        ]
        try:
            out = stack(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                position_ids=positions[start : start + length].unsqueeze(0),
                use_cache=False,
            )
        finally:
            for handle in handles:
                handle.remove()
        finals.append(out.last_hidden_state[0])
        for slot, k in enumerate(layers_to_capture):
            captured[slot].append(caught[k][0])
        start += length
    return torch.cat(finals), [torch.cat(parts) for parts in captured]


class Decoder(torch.nn.Module):
    """A model class's decoder: ``layers_to_capture`` is what ``set_eagle3_layers_to_capture`` sets."""

    layers_to_capture: list[int]


class CausalLM(torch.nn.Module):
    """A transformers causal LM as SGLang's model classes present one: ``model`` (the decoder, which
    holds ``layers_to_capture``), ``lm_head``, ``logits_processor``, ``forward(input_ids, positions,
    forward_batch)``."""

    decoder_class: type[Decoder]

    def __init__(self, language_model: Any) -> None:
        super().__init__()
        from eagle3_pipeline.target import decoder

        self.config = language_model.config
        self.model = self.decoder_class(decoder(language_model))
        self.lm_head = language_model.lm_head
        self.logits_processor = LogitsProcessor()
        self.capture_aux_hidden_states = False

    def forward(self, input_ids: Any, positions: Any, forward_batch: Any) -> Any:
        hidden, aux = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(
            input_ids, hidden, self.lm_head, forward_batch, aux if self.capture_aux_hidden_states else None
        )
