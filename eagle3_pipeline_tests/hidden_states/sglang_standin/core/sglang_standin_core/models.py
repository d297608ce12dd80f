"""The stand-in's models, backed by transformers: a causal LM whose decoder runs each request of a
packed batch alone and catches the residual stream entering the layers in ``layers_to_capture``,
and SGLang's two rules that turn a drafter's ids into ``layers_to_capture``."""

from __future__ import annotations

from typing import Any

import torch

from sglang_standin_core.logits import LogitsProcessor


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
    """A model class's decoder: ``layers_to_capture`` is what ``set_eagle3_layers_to_capture`` sets.
    A release's decoder class defines ``forward``, collecting the captured states the way that
    release's decoder does (a list, or one packed tensor)."""

    def __init__(self, stack: Any) -> None:
        super().__init__()
        self.stack = stack
        self.layers_to_capture: list[int] = []

    def captured(self, input_ids: Any, positions: Any, forward_batch: Any) -> tuple[Any, list[Any]]:
        return run_requests(self.stack, self.layers_to_capture, input_ids, positions, forward_batch)


class CausalLM(torch.nn.Module):
    """A transformers causal LM as SGLang's model classes present one: ``model`` (the decoder, which
    holds ``layers_to_capture``), ``lm_head``, ``logits_processor``, ``forward(input_ids, positions,
    forward_batch)``."""

    decoder_class: type[Decoder]

    def __init__(self, language_model: Any) -> None:
        super().__init__()
        from eagle3_pipeline.target.folder import decoder

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

    def _default_layers(self) -> list[int]:
        layers = self.config.num_hidden_layers
        return [2, layers // 2, layers - 3]


def llama_rule(model: CausalLM, layer_ids: list[int] | None) -> None:
    """SGLang's Llama rule: the input of layer ``id + 1`` (the output of layer ``id``) for every id."""
    model.capture_aux_hidden_states = True
    model.model.layers_to_capture = model._default_layers() if layer_ids is None else [i + 1 for i in layer_ids]


def deepseek_rule(model: CausalLM, layer_ids: list[int] | None) -> None:
    """SGLang's DeepSeek rule from 0.5.13: ``id + 1`` only when the first id is 1, the ids as written otherwise."""
    model.capture_aux_hidden_states = True
    if layer_ids is None:
        model.model.layers_to_capture = model._default_layers()
    elif layer_ids and layer_ids[0] == 1:
        model.model.layers_to_capture = [i + 1 for i in layer_ids]
    else:
        model.model.layers_to_capture = list(layer_ids)


def load_model(model_config: Any, classes: dict[str, type[torch.nn.Module]]) -> torch.nn.Module:
    """The checkpoint's architecture as the release's model class, on the CPU."""
    from eagle3_pipeline.target.folder import language_model, load_causal_lm

    [architecture] = model_config.hf_config.architectures
    if architecture not in classes:
        raise ValueError(f"stand-in: no model class for {architecture} (it has {sorted(classes)})")
    dtype = "float32" if model_config.dtype == "auto" else model_config.dtype
    loaded = load_causal_lm(model_config.model_path, model_config.trust_remote_code, dtype, "cpu")
    return classes[architecture](language_model(loaded)).eval()
