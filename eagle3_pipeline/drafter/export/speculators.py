"""Our export converted to the vLLM ``speculators`` layout (``speculators_model_type: eagle3``), for
vLLM users who prefer it (vllm serve DIR reads the target and the number of drafted tokens from it).

Layout as read from vllm-project/speculators (``models/eagle3/config.py``, the EAGLE-3 converter)
and vLLM's ``transformers_utils/configs/speculators/{base,algos}.py``:

- ``config.json``: ``architectures: ["Eagle3Speculator"]``, ``speculators_model_type: "eagle3"``,
  ``transformer_layer_config`` (the Llama config of the one decoder layer: target vocabulary,
  draft dimensions, RoPE), ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` (our export's vLLM value, input of layer, used as-is; see
  :mod:`eagle3_pipeline.target.layer_ids`), ``norm_before_residual: false`` written out (vLLM's adapter
  assumes true when it is absent; our layer keeps the un-normed residual), and ``speculators_config``:
  ``algorithm``, one greedy proposal method with ``speculative_tokens``, and the ``verifier``
  (``name_or_path``, ``architectures``).
- ``model.safetensors``: the decoder layer under ``layers.0.*`` instead of ``midlayer.*``, and
  ``embed_tokens.weight`` always (a speculators model owns its embedding; ours is the target's).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from eagle3_pipeline.drafter.export.formats import ARCHITECTURE, CONFIG_FILE, WEIGHTS_FILE
from eagle3_pipeline.drafter.model.draft_config import VARIANT_KEYS, DrafterConfig, DrafterConfigError
from eagle3_pipeline.target.layer_ids import output_layer_ids

SPECULATORS_TYPE = "eagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose layout this follows
LAYER_PREFIX, OUR_LAYER_PREFIX = "layers.0.", "midlayer."


def is_speculators_config(raw: dict[str, Any]) -> bool:
    return raw.get("speculators_model_type") is not None


def speculators_config(
    export: dict[str, Any], verifier: str, verifier_architectures: list[str], speculative_tokens: int
) -> dict[str, Any]:
    """The speculators ``config.json`` for our export's ``config.json``."""
    layer_keys = (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta",
        "rope_scaling", "attention_bias", "mlp_bias", "tie_word_embeddings", "torch_dtype",
    )  # fmt: skip
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": SPECULATORS_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {key: export[key] for key in layer_keys if key in export},
        "draft_vocab_size": export["draft_vocab_size"],
        "target_hidden_size": export.get("target_hidden_size", export["hidden_size"]),
        "eagle_aux_hidden_state_layer_ids": list(export["eagle_aux_hidden_state_layer_ids"]),
        "norm_before_residual": False,
        "speculators_config": {
            "algorithm": SPECULATORS_TYPE,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
    }


def config_from_speculators(raw: dict[str, Any], where: Path) -> DrafterConfig:
    """Our model's dimensions from a speculators ``config.json`` (EAGLE-3 with one Llama layer)."""
    if raw.get("speculators_model_type") != SPECULATORS_TYPE:
        raise DrafterConfigError(
            f"{where}: speculators_model_type is {raw.get('speculators_model_type')!r}, expected {SPECULATORS_TYPE!r}"
        )
    if raw.get("norm_before_residual", False):
        raise DrafterConfigError(
            f"{where}: norm_before_residual is true; this drafter keeps the un-normed residual (false)"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict) or layer.get("num_hidden_layers", 1) != 1:
        raise DrafterConfigError(f"{where}: transformer_layer_config must be a Llama config with num_hidden_layers 1")
    try:
        return DrafterConfig(
            hidden_size=layer["hidden_size"],
            target_hidden_size=raw.get("target_hidden_size") or layer["hidden_size"],
            intermediate_size=layer["intermediate_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
            head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
            vocab_size=layer["vocab_size"],
            draft_vocab_size=raw["draft_vocab_size"],
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            rope_theta=layer.get("rope_theta", 10000.0),
            rope_scaling=layer.get("rope_scaling"),
            max_position_embeddings=layer["max_position_embeddings"],
            aux_layer_ids=output_layer_ids(raw["eagle_aux_hidden_state_layer_ids"]),
        )
    except KeyError as exc:
        raise DrafterConfigError(f"{where}: missing {exc.args[0]!r} in the speculators config") from None


def our_weight_names(tensors: dict[str, Any]) -> dict[str, Any]:
    return {
        (OUR_LAYER_PREFIX + k[len(LAYER_PREFIX) :] if k.startswith(LAYER_PREFIX) else k): v for k, v in tensors.items()
    }


def to_speculators(
    export_dir: Path, out_dir: Path, target_model_dir: Path, verifier: str | None = None, speculative_tokens: int = 3
) -> Path:
    """Write ``out_dir`` in the speculators layout from our export ``export_dir``. The target model
    folder gives the embedding (when the export does not carry it) and the verifier's
    architectures; ``verifier`` is what vLLM loads as the target (default: that folder)."""
    from safetensors.torch import load_file, save_file

    from eagle3_pipeline.target.weights import embedding_tensor

    if speculative_tokens < 1:
        raise DrafterConfigError(f"speculative_tokens {speculative_tokens}: expected at least 1")
    export_dir, out_dir, target_model_dir = Path(export_dir), Path(out_dir), Path(target_model_dir)
    export = json.loads((export_dir / CONFIG_FILE).read_text())
    if export.get("architectures") != [ARCHITECTURE]:
        raise DrafterConfigError(
            f"{export_dir / CONFIG_FILE}: architectures is {export.get('architectures')}, expected [{ARCHITECTURE!r}]"
        )
    variants = [key for key in VARIANT_KEYS if export.get(key)]
    if variants:
        raise DrafterConfigError(
            f"{export_dir / CONFIG_FILE}: {', '.join(variants)} on; the speculators layout is written for the plain "
            "EAGLE-3 drafter only. vLLM and SGLang serve this export from its own folder"
        )
    target = json.loads((target_model_dir / CONFIG_FILE).read_text())
    tensors = load_file(str(export_dir / WEIGHTS_FILE))
    dtype = tensors["fc.weight"].dtype
    if "embed_tokens.weight" not in tensors:
        tensors["embed_tokens.weight"] = embedding_tensor(target_model_dir).to(dtype)
    renamed = {
        (LAYER_PREFIX + k[len(OUR_LAYER_PREFIX) :] if k.startswith(OUR_LAYER_PREFIX) else k): v.contiguous()
        for k, v in tensors.items()
    }
    config = speculators_config(
        export, verifier or str(target_model_dir), list(target.get("architectures") or []), speculative_tokens
    )
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(renamed, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
