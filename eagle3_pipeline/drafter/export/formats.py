"""The names our drafter export is written under, shared by the export (:mod:`eagle3_pipeline.drafter.export.specforge`)
and its speculators conversion (:mod:`eagle3_pipeline.drafter.export.speculators`), which reads an export.

An export is a folder with the drafter's ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``,
the architecture SGLang and vLLM serve an EAGLE-3 Llama drafter as, or ``["Eagle3DeepseekV2ForCausalLM"]``
for the MLA head) and its ``model.safetensors``.
The aux layer ids the config carries are converted in one place, :mod:`eagle3_pipeline.target.layer_ids`.
"""

from __future__ import annotations

ARCHITECTURE = "LlamaForCausalLMEagle3"
# The MLA draft head's (drafter.model.attention: mla): vLLM 0.32 registry.py -> deepseek_eagle3.py, SGLang
# 0.5.23 models/kimi_k25_eagle3.py; its config.json is a DeepSeek-V3 one.
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MLA_MODEL_TYPE = "deepseek_v2"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
