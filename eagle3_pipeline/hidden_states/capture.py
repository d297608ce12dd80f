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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.hidden_states.store import TargetIdentity
from eagle3_pipeline.target.folder import (
    TargetError,
    config_sha256,
    decoder,
    dimensions,
    language_model,
    load_causal_lm,
    read_config,
)
from eagle3_pipeline.target.layer_ids import LLAMA, server_layer_ids, target_family


class TargetLoadError(TargetError):
    """The target model cannot be loaded, or its layout is not one this capture understands."""


class SampleError(RuntimeError):
    """A source's refusal of one sequence of a batch (``index``: its place in the batch); the loop
    (:mod:`eagle3_pipeline.hidden_states.extract`) re-raises it as an ``ExtractionError`` naming
    the sample."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index
        self.message = message


@dataclass
class Target:
    """The target in this process: a state source of the `extract` loop
    (:class:`eagle3_pipeline.hidden_states.extract.StateSource`), one process that writes."""

    model: Any
    identity: TargetIdentity
    device: str
    dtype: str
    family: str = LLAMA
    writer = True
    spot_check_method = "alone through the whole causal LM with transformers' output_hidden_states (no padding)"

    @property
    def input_device(self) -> Any:
        return self.model.get_input_embeddings().weight.device

    def describe(self) -> str:
        return f"transformers on {self.device}/{self.dtype}"

    def capture(self, aux_layer_ids: Sequence[int]) -> dict[str, Any]:
        """How the states are captured, for the store's manifest. Layers no drafter config could
        make the servers read (:func:`eagle3_pipeline.target.layer_ids.server_layer_ids`) are refused
        here, before anything is extracted."""
        server_layer_ids(self.family, aux_layer_ids)
        return {"backend": "transformers", "device": self.device, "dtype": self.dtype}

    def share(self, value: Any) -> Any:
        return value

    def batch_states(self, aux_layer_ids: Sequence[int], sequences: Sequence[Sequence[int]]) -> list[tuple[Any, Any]]:
        return batch_states(self, aux_layer_ids, sequences)

    def reference_states(self, aux_layer_ids: Sequence[int], sequence: Sequence[int]) -> tuple[Any, Any]:
        return reference_states(self, aux_layer_ids, sequence)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise TargetLoadError("hidden_states.device is 'cuda' but torch sees no CUDA device")
    return device


def load_target(model: str, name: str, device: str, dtype: str, trust_remote_code: bool) -> Target:
    """The target through :func:`eagle3_pipeline.target.folder.load_causal_lm` (which refuses what this
    path cannot execute), its identity from the language model's config. ``device``, ``dtype`` and
    ``trust_remote_code`` are the file's ``hidden_states`` and ``target`` settings (no default here)."""
    where = resolve_device(device)
    chosen = dtype if dtype != "auto" else ("bfloat16" if where == "cuda" else "float32")
    loaded = load_causal_lm(model, trust_remote_code, chosen, where)
    identity = target_identity(model, name)
    decoder_layers(loaded)
    return Target(loaded, identity, where, chosen, target_family(read_config(model)))


def target_identity(model: str, name: str) -> TargetIdentity:
    """The identity :func:`load_target` records, from the target's ``config.json`` alone (no
    weights loaded, no code run): the language model's depth and sizes, nested configs resolved."""
    raw = read_config(model)
    dims = dimensions(raw, f"target model {model!r} config.json")
    return TargetIdentity(
        name=name,
        config_sha256=config_sha256(model),
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        vocab_size=dims.vocab_size,
    )


def decoder_layers(model: Any) -> Sequence[Any]:
    try:
        return list(decoder(model).layers)
    except TargetError as exc:
        raise TargetLoadError(str(exc)) from None


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


def batch_states(
    target: Target, aux_layer_ids: Sequence[int], sequences: Sequence[Sequence[int]]
) -> list[tuple[Any, Any]]:
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
        out = decoder(target.model)(
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
        out = language_model(target.model)(input_ids=ids, output_hidden_states=True, logits_to_keep=1, use_cache=False)
    states = out.hidden_states
    aux = torch.cat([states[i + 1][0].to(ids.device) for i in aux_layer_ids], dim=-1)
    return aux, states[-1][0]
