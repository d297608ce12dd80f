"""The names our drafter export is written under, shared by the export (:mod:`eagle3_pipeline.drafter.export`)
and its speculators conversion (:mod:`eagle3_pipeline.drafter.speculators`), which reads an export.

An export is a folder with the drafter's ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``,
the architecture SGLang and vLLM serve an EAGLE-3 Llama drafter as) and its ``model.safetensors``.
The aux layer ids the config carries are converted in one place, :mod:`eagle3_pipeline.target.layer_ids`.
"""

from __future__ import annotations

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
