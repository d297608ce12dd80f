"""Which aux layer ids a drafter's config.json must carry so that SGLang and vLLM capture the target
layers it was trained on.

Our stores number captured layers output-of-layer (id ``k`` = the output of decoder layer ``k``); both
servers capture the residual stream entering a layer, but read the drafter's ids by different rules:
vLLM as written, SGLang ``id + 1``, and its DeepSeek family (:data:`DEEPSEEK_ARCHITECTURES`) only when
the first id is 1 since 0.5.13. :func:`server_layer_ids` writes each server's value and refuses a
DeepSeek-family first id that no SGLang release range (:data:`SGLANG_RELEASES`) reads the same way.
The rules per release, with their source lines: docs/eagle3.md "Aux layer ids per SGLang release".
No torch here: plain Python used by the export and the speculators conversion.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LLAMA, DEEPSEEK = "llama", "deepseek"
FAMILIES = (LLAMA, DEEPSEEK)
# The SGLang releases whose layer-id rules were read (every release from the first to the last, their
# models/*.py; eagle3_pipeline_tests/drafter/test_sglang_layer_rules.py reads 0.5.10, 0.5.12.post1,
# 0.5.13, 0.5.14 and 0.5.23 again): the range an export states (``eagle3_pipeline.sglang_versions``).
SGLANG_RELEASES = ">=0.5.10,<=0.5.23"
# SGLang model classes (config.json ``architectures``, which SGLang picks the class by) whose
# set_eagle3_layers_to_capture follows the DeepSeek rule; sglang 0.5.23 wheel, sglang/srt/models/:
DEEPSEEK_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",  # deepseek_v2.py:3248, the rule at 3458-3473 ("if layer_ids and layer_ids[0] == 1")
    "DeepseekV3ForCausalLM",  # deepseek_v2.py:3518, a subclass (DeepSeek-V3, Kimi-K2)
    "DeepseekV32ForCausalLM",  # deepseek_v2.py:3522, a subclass
    "KimiK25ForConditionalGeneration",  # kimi_k25.py:928-939 forwards to its DeepseekV3ForCausalLM (kimi_k25.py:693)
    "GlmMoeDsaForCausalLM",  # glm4_moe.py:1284, a subclass of DeepseekV2ForCausalLM (GLM-5)
    "Glm4MoeLiteForCausalLM",  # glm4_moe_lite.py:805-820, its own copy of the rule (GLM-4.7-Flash)
    "MistralLarge3ForCausalLM",  # mistral_large_3.py:12, a subclass of DeepseekV3ForCausalLM
)
# The config.json model_type values of those targets (outer or nested text_config): a checkpoint whose
# architectures are missing or name a wrapper is still recognised. SGLang reads Mistral Large 3's
# Mistral-format params as model_type deepseek_v3 (utils/hf_transformers/mistral_utils.py:77-82).
DEEPSEEK_MODEL_TYPES = (
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "kimi_k2",
    "kimi_k25",
    "glm_moe_dsa",
    "glm4_moe_lite",
)


class LayerIdError(ValueError):
    """Layer ids that no drafter config can make both servers capture; the message says why."""


@dataclass(frozen=True)
class ServerLayerIds:
    """The two values a drafter's config.json carries for the same captured layers."""

    sglang: list[int]  # eagle_config.eagle_aux_hidden_state_layer_ids
    vllm: list[int]  # top-level eagle_aux_hidden_state_layer_ids


def target_family(target_config: Mapping[str, Any]) -> str:
    """:data:`DEEPSEEK` when the target's ``architectures`` or ``model_type`` (or its nested
    ``text_config``'s) names a DeepSeek-family model, else :data:`LLAMA`."""
    nested = target_config.get("text_config")
    configs = [target_config, *([nested] if isinstance(nested, Mapping) else [])]
    types = {config.get("model_type") for config in configs}
    architectures = {name for config in configs for name in config.get("architectures") or []}
    deepseek = types & set(DEEPSEEK_MODEL_TYPES) or architectures & set(DEEPSEEK_ARCHITECTURES)
    return DEEPSEEK if deepseek else LLAMA


def server_layer_ids(family: str, output_ids: Sequence[int]) -> ServerLayerIds:
    """The ids to write for layers trained on in the output-of-layer convention (module docstring)."""
    if family not in FAMILIES:
        raise LayerIdError(f"target family {family!r}: expected one of {list(FAMILIES)}")
    ids = [int(i) for i in output_ids]
    if not ids or any(i < 0 for i in ids):
        raise LayerIdError(f"aux layer ids {ids}: expected output-of-layer ids >= 0")
    if family == DEEPSEEK and ids[0] != 1:
        raise LayerIdError(
            f"aux layer ids {ids}: a DeepSeek-family target (SGLang models/deepseek_v2.py: DeepSeek-V3, "
            "Kimi-K2/K2.5, GLM-5, GLM-4.7-Flash, Mistral Large 3) reads the first id 1 alike in every SGLang release "
            "from 0.5.10, but another first id differently in 0.5.10-0.5.12 (+1 to every id) and 0.5.13+ (the ids as "
            "written): no config.json makes both capture the trained layers. Train with the first id 1 "
            "(hidden_states.aux_layer_ids; the default [1, N/2-1, N-4] is)"
        )
    return ServerLayerIds(sglang=ids, vllm=[i + 1 for i in ids])


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
