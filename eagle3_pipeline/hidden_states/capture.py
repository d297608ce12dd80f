"""The target model in process (transformers): its identity, batched capture and a reference pass.

Two independent ways to get one sample's states, so each checks the other:

- :func:`batch_states` (extraction): right-padded batches through the base model only (no
  ``lm_head``, so no [tokens × vocab] logits), the aux layers caught by forward hooks on the decoder
  layers and the teacher taken from ``last_hidden_state``, the output of the final norm.
- :func:`reference_states` (spot check): one sample, no padding, through the whole causal LM with
  transformers' own ``output_hidden_states=True``; ``hidden_states[k + 1]`` is the output of layer
  ``k`` and ``hidden_states[-1]`` is the final norm's output.

CPU runs in float32. With CUDA (``device: auto`` finds it, or ``device: cuda``) the model is loaded
in bfloat16 with ``device_map="auto"`` across the visible GPUs; that path is not exercised by this
project's tests (no GPU on its machines).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.hidden_states.store import TargetIdentity


class TargetLoadError(ValueError):
    """The target model cannot be loaded, or its layout is not one this capture understands."""


@dataclass
class Target:
    model: Any
    identity: TargetIdentity
    device: str
    dtype: str

    @property
    def input_device(self) -> Any:
        return self.model.get_input_embeddings().weight.device


def config_sha256(model: str) -> str:
    """SHA-256 of the target's ``config.json`` bytes (a local folder or a Hugging Face id)."""
    from transformers.utils import cached_file

    try:
        path = cached_file(model, "config.json")
    except OSError as exc:
        raise TargetLoadError(f"target model {model!r}: no config.json ({exc})") from None
    if path is None:
        raise TargetLoadError(f"target model {model!r}: no config.json")
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise TargetLoadError("hidden_states.device is 'cuda' but torch sees no CUDA device")
    return device


def load_target(model: str, name: str, device: str = "auto", dtype: str = "auto") -> Target:
    import torch
    from transformers import AutoModelForCausalLM

    where = resolve_device(device)
    chosen = dtype if dtype != "auto" else ("bfloat16" if where == "cuda" else "float32")
    kwargs: dict[str, Any] = {"dtype": getattr(torch, chosen)}
    if where == "cuda":
        kwargs["device_map"] = "auto"
    try:
        loaded = AutoModelForCausalLM.from_pretrained(model, **kwargs)
    except (OSError, ValueError) as exc:
        raise TargetLoadError(f"target model {model!r}: cannot load it with transformers ({exc})") from None
    loaded.eval()
    identity = _identity(loaded.config, model, name)
    decoder_layers(loaded)
    return Target(loaded, identity, where, chosen)


def _identity(config: Any, model: str, name: str) -> TargetIdentity:
    text = config.get_text_config()
    return TargetIdentity(
        name=name,
        config_sha256=config_sha256(model),
        num_layers=int(text.num_hidden_layers),
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
    )


def target_identity(model: str, name: str) -> TargetIdentity:
    """The identity :func:`load_target` records, from the target's ``config.json`` alone (no
    weights loaded): what a store imported from another tool's states must carry."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise TargetLoadError(f"target model {model!r}: cannot read its config.json with transformers ({exc})") from None
    return _identity(config, model, name)


def decoder_layers(model: Any) -> Sequence[Any]:
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise TargetLoadError(f"{type(model).__name__}: no decoder layer list at base_model.layers; cannot capture aux states")
    return list(layers)


def check_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> None:
    if aux_layer_ids[-1] >= num_layers - 1:
        raise TargetLoadError(
            f"hidden_states.aux_layer_ids: expected ids in 0..{num_layers - 2} (outputs of layers before the last "
            f"of the target's {num_layers}), got {list(aux_layer_ids)}"
        )


@contextmanager
def _capture(layers: Sequence[Any], ids: Sequence[int]) -> Iterator[dict[int, Any]]:
    caught: dict[int, Any] = {}

    def hook_for(index: int) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            caught[index] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in ids]
    try:
        yield caught
    finally:
        for handle in handles:
            handle.remove()


def batch_states(target: Target, aux_layer_ids: Sequence[int], sequences: Sequence[Sequence[int]]) -> list[tuple[Any, Any]]:
    """``(aux [T, 3H], hidden [T, H])`` per sequence, from one right-padded forward pass.

    Right padding keeps every real token at its own position (0..T-1) and, under the causal mask,
    no real token attends to a pad, so a sample's states do not depend on its batch companions
    beyond floating-point reassociation.
    """
    import torch

    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros(len(sequences), longest, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        mask[row, : len(sequence)] = 1
    positions = torch.arange(longest).unsqueeze(0).expand(len(sequences), -1)
    device = target.input_device
    layers = decoder_layers(target.model)
    with torch.inference_mode(), _capture(layers, aux_layer_ids) as caught:
        out = target.model.base_model(
            input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device), use_cache=False
        )
        aux = torch.cat([caught[i].to(device) for i in aux_layer_ids], dim=-1)
        hidden = out.last_hidden_state
    return [(aux[row, : len(s)], hidden[row, : len(s)]) for row, s in enumerate(sequences)]


def reference_states(target: Target, aux_layer_ids: Sequence[int], sequence: Sequence[int]) -> tuple[Any, Any]:
    """One sample alone through the whole causal LM with ``output_hidden_states=True``."""
    import torch

    ids = torch.tensor([list(sequence)], dtype=torch.long, device=target.input_device)
    with torch.inference_mode():
        out = target.model(input_ids=ids, output_hidden_states=True, logits_to_keep=1, use_cache=False)
    states = out.hidden_states
    aux = torch.cat([states[i + 1][0].to(ids.device) for i in aux_layer_ids], dim=-1)
    return aux, states[-1][0]
