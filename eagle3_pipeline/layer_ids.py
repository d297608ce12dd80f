"""Which aux layer ids a drafter's config.json must carry so that SGLang and vLLM capture the target
layers it was trained on.

Our stores number captured layers output-of-layer (id ``k`` = the output of decoder layer ``k``,
``eagle3_pipeline.hidden_states.store``). Both servers capture the residual stream *entering* a layer
(index ``i`` = input of layer ``i`` = output of layer ``i - 1``), but read the drafter's ids by
different rules, read from the released sources:

- SGLang (sglang 0.5.14 and 0.5.23 wheels on PyPI) reads ``eagle_config.eagle_aux_hidden_state_layer_ids``
  and hands it to the target model's ``set_eagle3_layers_to_capture``. Llama and the other dense and
  MoE families (``models/llama.py``, qwen2/qwen3, gemma3, glm4_moe, gpt_oss, ...) capture ``id + 1`` for
  every id. ``models/deepseek_v2.py`` (DeepSeek-V2/V3/V3.2, and Kimi-K2/K2.5, whose language model it
  is: ``models/kimi_k25.py`` forwards the call) captures ``id + 1`` **only when the first id is 1**,
  and the ids as written otherwise.
- vLLM (0.34.0, ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.get_eagle3_aux_layers_from_config``)
  reads the top-level ``eagle_aux_hidden_state_layer_ids`` and captures them as written, for every
  family.

So vLLM's value is always ``id + 1``; SGLang's is the trained ids for a Llama-like target, and for a
DeepSeek-family target the trained ids when the first is 1, else ``id + 1`` (which the ``first id is
1`` rule then leaves alone). Output of layer 0 cannot be served from a DeepSeek-family target: written
as 0 SGLang captures layer 0's input, written as 1 it adds 1.

No torch here: plain Python used by the export and the speculators conversion.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LLAMA, DEEPSEEK = "llama", "deepseek"
FAMILIES = (LLAMA, DEEPSEEK)
# model_type values served by SGLang's models/deepseek_v2.py (kimi_k25 wraps it; the nested text_config
# of a Kimi-K2.5 checkpoint says deepseek_v3, the outer config kimi_k25).
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25")


class LayerIdError(ValueError):
    """Layer ids that no drafter config can make both servers capture; the message says why."""


@dataclass(frozen=True)
class ServerLayerIds:
    """The two values a drafter's config.json carries for the same captured layers."""

    sglang: list[int]  # eagle_config.eagle_aux_hidden_state_layer_ids
    vllm: list[int]  # top-level eagle_aux_hidden_state_layer_ids


def target_family(target_config: Mapping[str, Any]) -> str:
    """:data:`DEEPSEEK` when the target's ``model_type`` (or its nested ``text_config``'s) is a
    DeepSeek-V2/V3 or Kimi-K2 model type, else :data:`LLAMA`."""
    nested = target_config.get("text_config")
    types = {target_config.get("model_type"), nested.get("model_type") if isinstance(nested, Mapping) else None}
    return DEEPSEEK if types & set(DEEPSEEK_MODEL_TYPES) else LLAMA


def server_layer_ids(family: str, output_ids: Sequence[int]) -> ServerLayerIds:
    """The ids to write for layers trained on in the output-of-layer convention (module docstring)."""
    if family not in FAMILIES:
        raise LayerIdError(f"target family {family!r}: expected one of {list(FAMILIES)}")
    ids = [int(i) for i in output_ids]
    if not ids or any(i < 0 for i in ids):
        raise LayerIdError(f"aux layer ids {ids}: expected output-of-layer ids >= 0")
    shifted = [i + 1 for i in ids]
    if family == LLAMA or ids[0] == 1:
        return ServerLayerIds(sglang=ids, vllm=shifted)
    if ids[0] == 0:
        raise LayerIdError(
            f"aux layer ids {ids}: SGLang's DeepSeek/Kimi target (models/deepseek_v2.py) cannot capture the output "
            "of layer 0 (written 0 it captures layer 0's input, written 1 it adds 1); train on layers from 1 up "
            "(hidden_states.aux_layer_ids)"
        )
    return ServerLayerIds(sglang=shifted, vllm=shifted)


def extraction_layer_ids(family: str, output_ids: Sequence[int], num_layers: int) -> list[int]:
    """vLLM's ``eagle_aux_hidden_state_layer_ids`` for ``extract_hidden_states`` of a store trained on
    ``output_ids``: the inputs of layers id + 1, then ``num_layers`` (the last layer's output, before the
    final norm)."""
    return [*server_layer_ids(family, output_ids).vllm, int(num_layers)]


def output_layer_ids(vllm_ids: Sequence[int]) -> list[int]:
    """The trained (output-of-layer) ids back from a config's vLLM value (input of layer, as-is)."""
    ids = [int(i) - 1 for i in vllm_ids]
    if not ids or any(i < 0 for i in ids):
        raise LayerIdError(f"eagle_aux_hidden_state_layer_ids {list(vllm_ids)}: expected input-of-layer ids >= 1")
    return ids
