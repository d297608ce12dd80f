"""The served drafter directory, loaded as-is by SGLang and vLLM (SpecForge's export layout).

``config.json``: a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``, one hidden layer,
the target's vocabulary size, ``draft_vocab_size``, untied embeddings, the RoPE the drafter was
trained with (``rope_theta`` and the legacy ``rope_scaling``, which SGLang's and vLLM's Llama readers
take through transformers 4 or 5; YaRN in the form
:func:`~eagle3_pipeline.drafter.model.draft_config.yarn_for_servers` gives, with both ``rope_type`` and ``type``,
which every reader interprets as trained), ``max_position_embeddings`` of the drafter (at least the
target's), and the captured layers written for both servers by
:func:`eagle3_pipeline.target.layer_ids.server_layer_ids` for the target's family:
``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang) and the top-level
``eagle_aux_hidden_state_layer_ids`` (vLLM, input of layer: the trained output-of-layer ids + 1, which
:func:`load_export` reads back). ``eagle3_pipeline`` records the target family those ids were written
for and the SGLang releases that read them as trained (``sglang_versions``,
:data:`eagle3_pipeline.target.layer_ids.SGLANG_RELEASES`); the servers ignore the key.

The variants (``fc_norm``, ``norm_output``, ``norm_before_fc``) are the top-level keys vLLM 0.32 and
SGLang 0.5.23 read (``models/llama_eagle3.py``), written only when on; ``eagle3_pipeline.training`` records
the loss and the checkpoint exported (``select``, its step and τ).

The MLA head (``attention: mla``): ``architectures: ["Eagle3DeepseekV2ForCausalLM"]``, ``model_type:
deepseek_v3`` (the DeepSeek-V3 config class both servers' MLA draft classes read), the MLA dims
(``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``),
``num_key_value_heads`` = ``num_attention_heads``, no ``head_dim`` (DeepSeek's config derives its own) and
the target's DeepSeek ``rope_scaling`` as trained
(:func:`~eagle3_pipeline.drafter.model.draft_config.check_deepseek_rope`); its attention weights are
``midlayer.self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj}.weight``, which vLLM renames ``layers.0.*`` and fuses q_a/kv_a into
``fused_qkv_a_proj`` and SGLang fuses into ``fused_qkv_a_proj_with_mqa``.

``model.safetensors``: ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``,
``t2d`` (not for a full draft vocabulary: vLLM refuses them then), ``fc_norm.{0,1,2}.weight`` or
``input_norm.weight`` for those variants;
``embed_tokens.weight`` only when the draft hidden size differs from the target's (the servers then
cannot share the target's embedding). The folder is written under a temporary name and renamed into
place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.drafter.export.formats import (
    ARCHITECTURE,
    CONFIG_FILE,
    MLA_ARCHITECTURE,
    MLA_MODEL_TYPE,
    WEIGHTS_FILE,
)
from eagle3_pipeline.drafter.export.speculators import config_from_speculators, is_speculators_config, our_weight_names
from eagle3_pipeline.drafter.model.draft_config import (
    MLA_KEYS,
    VARIANT_KEYS,
    DrafterConfig,
    DrafterConfigError,
    rope_kind,
    yarn_for_servers,
)
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
from eagle3_pipeline.target.layer_ids import SGLANG_RELEASES, output_layer_ids, server_layer_ids, target_family

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TARGET_FIELDS_KEPT = ("bos_token_id", "eos_token_id", "pad_token_id")


def served_rope_scaling(config: DrafterConfig) -> dict[str, Any] | None:
    """``rope_scaling`` as config.json carries it: YaRN in :func:`yarn_for_servers`'s form (``rope_type``
    and ``type`` both, the portable mscale pair), other scalings and the MLA head's DeepSeek YaRN as trained."""
    if rope_kind(config.rope_scaling) == "yarn" and config.attention != "mla":
        return yarn_for_servers(dict(config.rope_scaling or {}), "rope_scaling")
    return config.rope_scaling


def server_config(
    config: DrafterConfig, target_config: dict[str, Any], dtype: str, training: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The drafter's config.json for the target described by ``target_config`` (its language model's
    config, or the checkpoint's with a nested ``text_config``: the family is read from either).
    ``training`` (the loss, the checkpoint chosen and its τ) goes under ``eagle3_pipeline.training``."""
    if "vocab_size" in target_config and int(target_config["vocab_size"]) != config.vocab_size:
        raise DrafterConfigError(
            f"vocab_size: the drafter has {config.vocab_size}, the target config {target_config['vocab_size']}"
        )
    family = target_family(target_config)
    ids = server_layer_ids(family, config.aux_layer_ids)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": "silu",
        "rope_theta": config.rope_theta,
        "rope_scaling": served_rope_scaling(config),
        "max_position_embeddings": max(
            config.max_position_embeddings, int(target_config.get("max_position_embeddings", 0))
        ),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids.sglang, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": ids.vllm,
        "use_aux_hidden_state": True,
        "eagle3_pipeline": {"target_family": family, "sglang_versions": SGLANG_RELEASES},
    }
    if config.target_hidden_size != config.hidden_size:
        out["target_hidden_size"] = config.target_hidden_size
    # Top-level keys both servers read (eagle_config.norm_before_fc too, which they read first): written
    # only when on, so a plain EAGLE-3 export is the one it always was.
    out.update({key: True for key in VARIANT_KEYS if getattr(config, key)})
    if config.attention == "mla":
        del out["head_dim"]
        out.update(
            {
                "architectures": [MLA_ARCHITECTURE],
                "model_type": MLA_MODEL_TYPE,
                **{k: getattr(config, k) for k in MLA_KEYS},
            }
        )
    if training is not None:
        out["eagle3_pipeline"]["training"] = training
    out.update({k: target_config[k] for k in TARGET_FIELDS_KEPT if k in target_config})
    return out


def exported_tensors(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The state entries the weights file holds, as they are (no copy: works on a meta-device model).
    A full draft vocabulary (the identity ``d2t``) carries no ``d2t``/``t2d``: vLLM 0.32's EAGLE-3 classes
    build no ``draft_id_to_target_id`` then and refuse the weight; SGLang reads its absence as the identity."""
    drop = set() if model.config.hidden_size != model.config.target_hidden_size else {"embed_tokens.weight"}
    if model.config.draft_vocab_size == model.config.vocab_size and model.d2t.device.type != "meta":
        drop |= {"d2t", "t2d"} if not bool(model.d2t.any()) else set()
    return {name: tensor for name, tensor in model.state_dict().items() if name not in drop}


def export_weights(model: Eagle3Drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        name: (tensor.to(dtype) if tensor.is_floating_point() else tensor).detach().cpu().contiguous()
        for name, tensor in exported_tensors(model).items()
    }


def export_for_servers(
    model: Eagle3Drafter,
    folder: Path,
    target_config: dict[str, Any],
    dtype: str = "bfloat16",
    training: dict[str, Any] | None = None,
) -> Path:
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise DrafterConfigError(f"export dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(export_weights(model, DTYPES[dtype]), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(server_config(model.config, target_config, dtype, training), indent=2))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def config_from_export(raw: dict[str, Any]) -> DrafterConfig:
    mla = raw.get("architectures") == [MLA_ARCHITECTURE]
    mla_fields: dict[str, Any] = {"attention": "mla", **{k: int(raw[k]) for k in MLA_KEYS}} if mla else {}
    return DrafterConfig(
        hidden_size=raw["hidden_size"],
        target_hidden_size=raw.get("target_hidden_size", raw["hidden_size"]),
        intermediate_size=raw["intermediate_size"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"],
        head_dim=(
            raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
            if mla
            else raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
        ),
        vocab_size=raw["vocab_size"],
        draft_vocab_size=raw["draft_vocab_size"],
        rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=raw["rope_theta"],
        rope_scaling=raw.get("rope_scaling"),
        max_position_embeddings=raw["max_position_embeddings"],
        aux_layer_ids=output_layer_ids(raw["eagle_aux_hidden_state_layer_ids"]),
        fc_norm=bool(raw.get("fc_norm", False)),
        norm_output=bool(raw.get("norm_output", False)),
        norm_before_fc=bool((raw.get("eagle_config") or {}).get("norm_before_fc", raw.get("norm_before_fc", False))),
        **mla_fields,
    )


def load_export(folder: Path, target_model_dir: Path | None = None) -> Eagle3Drafter:
    """The exported drafter as our module, in float32. An export without ``embed_tokens.weight``
    (draft hidden = target hidden, the usual case) takes the embedding from ``target_model_dir``,
    as the servers do; without it the embedding is left unset and the call fails. A folder in the
    speculators layout (:mod:`eagle3_pipeline.drafter.export.speculators`) loads too."""
    from safetensors.torch import load_file

    from eagle3_pipeline.target.weights import embedding_tensor

    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise DrafterConfigError(f"{config_path}: no drafter config.json")
    raw = json.loads(config_path.read_text())
    tensors = load_file(str(folder / WEIGHTS_FILE))
    if is_speculators_config(raw):
        model = Eagle3Drafter(config_from_speculators(raw, config_path))
        tensors = our_weight_names(tensors)
    elif raw.get("architectures") not in ([ARCHITECTURE], [MLA_ARCHITECTURE]):
        raise DrafterConfigError(
            f"{config_path}: architectures is {raw.get('architectures')}, expected [{ARCHITECTURE!r}] or "
            f"[{MLA_ARCHITECTURE!r}]"
        )
    else:
        model = Eagle3Drafter(config_from_export(raw))
    if "embed_tokens.weight" not in tensors:
        if target_model_dir is None:
            raise DrafterConfigError(
                f"{folder}: the export carries no embed_tokens.weight; pass target_model_dir to take the target's"
            )
        tensors["embed_tokens.weight"] = embedding_tensor(Path(target_model_dir))
    if "d2t" not in tensors and model.config.draft_vocab_size == model.config.vocab_size:
        tensors["d2t"] = torch.zeros(model.config.vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(model.config.vocab_size, dtype=torch.bool)
    model.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}, strict=True)
    model.embed_tokens.weight.requires_grad_(False)
    return model
