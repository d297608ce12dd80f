"""The weights a target puts on each GPU, read from the checkpoint folder without loading a tensor.

What is read, best first:

- **the safetensors headers** (the first 8 + N bytes of each shard): every tensor's dtype and shape, so
  its exact bytes (``basis: headers``);
- **the index** (``model.safetensors.index.json``): the tensor names, hence the modules and their
  quantization (``weight_packed`` of compressed-tensors, ``weight_scale_inv`` of block FP8, ``qweight`` of
  AWQ/GPTQ), with each module's bytes from its shape in ``config.json`` and its format; the sum is scaled to
  the index's ``total_size`` (``basis: index``, the scale recorded);
- **config.json alone**: the same modules from the architecture (``basis: config``).

How tensor parallelism splits a module (SGLang's and vLLM's model classes agree on these): the embedding
and ``lm_head`` are vocabulary-parallel; q/o projections, MLPs and experts are split (experts by TP or
EP alike); the K/V projections of GQA hold ``max(kv_heads / tp, 1)`` heads per rank; norms, the MoE
router, MLA's ``q_a_proj`` / ``kv_a_proj_with_mqa`` and anything unrecognised (a vision tower) are
replicated. Layers past ``num_hidden_layers`` (DeepSeek's MTP layer) are not loaded for plain serving.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from eagle3_pipeline.target.folder import INDEX_FILE, SINGLE_FILE, is_mla, text_config

Split = Literal["tp", "kv", "replicated"]
Basis = Literal["headers", "index", "config"]
DTYPE_BYTES = {
    "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1,
    "I16": 2, "I32": 4, "I64": 8, "BOOL": 1, "F4": 0.5,
}  # fmt: skip
TORCH_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
# The last segment of a tensor name that belongs to its module (not a module of its own).
TENSOR_SUFFIXES = (
    "weight", "bias", "weight_packed", "weight_scale", "weight_scale_inv", "weight_shape", "weight_zero_point",
    "weight_global_scale", "input_scale", "input_global_scale", "qweight", "qzeros", "scales", "g_idx",
    "e_score_correction_bias", "weight_scale_2", "k_scale", "v_scale",
)  # fmt: skip
REPLICATED_MLA = ("q_a_proj", "kv_a_proj_with_mqa")


class CheckpointError(ValueError):
    """The checkpoint folder cannot be read as a model: the message names the file and field."""


@dataclass(frozen=True)
class Quantization:
    """How the checkpoint stores its linear layers: bytes per weight element of a quantized module and
    which modules are left in the base dtype."""

    method: str  # none, fp8, compressed-tensors, awq, gptq, nvfp4, mxfp4
    bytes_per_param: float
    ignore: tuple[str, ...] = ()  # exact module names or "re:<pattern>" (compressed-tensors' convention)
    experts_only: bool = False

    def applies(self, module: str) -> bool:
        if self.method == "none":
            return False
        if self.experts_only and ".experts." not in module:
            return False
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern) or module.endswith(pattern):
                return False
        return True


def quantization_of(raw: Mapping[str, Any]) -> Quantization:
    """The checkpoint's quantization from ``quantization_config`` (outer or nested)."""
    quant = raw.get("quantization_config") or text_config(raw).get("quantization_config")
    if not isinstance(quant, dict):
        return Quantization("none", 0.0)
    method = str(quant.get("quant_method") or quant.get("quant_algo") or "").lower()
    ignore = tuple(
        str(x)
        for x in (quant.get("ignore") or quant.get("modules_to_not_convert") or quant.get("exclude_modules") or [])
    )
    if method == "fp8":
        block = quant.get("weight_block_size") or [128, 128]
        return Quantization("fp8", 1 + 4 / (int(block[0]) * int(block[1])), ignore)
    if method == "compressed-tensors":
        groups = quant.get("config_groups") or {}
        weights = next((g.get("weights") for g in groups.values() if isinstance(g, dict) and g.get("weights")), None)
        if not isinstance(weights, dict):
            return Quantization("compressed-tensors", 1.0, ignore)
        bits = int(weights.get("num_bits") or 8)
        group = weights.get("group_size")
        scale = (2 / int(group)) if group else 0.0
        return Quantization(
            f"compressed-tensors int{bits}"
            if weights.get("type") == "int"
            else f"compressed-tensors {weights.get('type')}{bits}",
            bits / 8 + scale,
            ignore,
        )
    if method in ("awq", "gptq"):
        bits, group = (
            int(quant.get("bits") or quant.get("w_bit") or 4),
            int(quant.get("group_size") or quant.get("q_group_size") or 128),
        )
        return Quantization(method, bits / 8 + (2 + bits / 8) / max(group, 1), ignore or ("lm_head",))
    if method in ("modelopt", "nvfp4") or "fp4" in method:
        algo = str(quant.get("quant_algo") or method).lower()
        if "nvfp4" in algo:
            return Quantization("nvfp4", 0.5 + 1 / 16, ignore)
        if "fp8" in algo:
            return Quantization("fp8", 1.0, ignore)
    if method == "mxfp4":
        return Quantization("mxfp4", 0.5 + 1 / 32, ignore, experts_only=True)
    raise CheckpointError(
        f"config.json quantization_config.quant_method {method!r}: not a format this model knows "
        "(fp8, compressed-tensors, awq, gptq, modelopt nvfp4/fp8, mxfp4)"
    )


@dataclass(frozen=True)
class Module:
    """One module of the checkpoint (the tensors under one name prefix)."""

    name: str
    layer: int | None
    split: Split
    bytes: float
    fp32: bool = False  # stored in float32: the engines serve it in bfloat16 (dtype auto downcasts)


@dataclass
class Weights:
    """A checkpoint's modules and how they land on ``tp`` GPUs."""

    modules: list[Module]
    basis: Basis
    total_bytes: float  # what the files hold, all modules (MTP layers and vision tower included)
    num_layers: int
    kv_heads: int
    quantization: str
    scale: float = 1.0  # index basis: total_size / the modules' estimated sum
    notes: list[str] = field(default_factory=list)

    def loaded(self, with_mtp: bool = False) -> list[Module]:
        return [m for m in self.modules if with_mtp or m.layer is None or m.layer < self.num_layers]

    def per_gpu_bytes(
        self, tp: int, attention_tp: int | None = None, with_mtp: bool = False, downcast_fp32: bool = True
    ) -> float:
        """Bytes of weights on each of ``tp`` GPUs (``attention_tp``: the attention's own TP degree under data-
        parallel attention; default ``tp``). ``downcast_fp32``: float32 modules count as bfloat16, as SGLang and
        vLLM load them with dtype auto (vLLM logs "Downcasting torch.float32 to torch.bfloat16")."""
        attn_tp = attention_tp or tp
        total = 0.0
        for module in self.loaded(with_mtp):
            attention = ".self_attn." in module.name or module.name.endswith("self_attn")
            ranks = attn_tp if attention else tp
            size = module.bytes / 2 if downcast_fp32 and module.fp32 else module.bytes
            if module.split == "replicated":
                total += size
            elif module.split == "kv":
                total += size * max(1 / ranks, 1 / max(self.kv_heads, 1))
            else:
                total += size / ranks
        return total


def _layer_of(name: str) -> int | None:
    found = re.search(r"\.layers\.(\d+)\.", name)
    return int(found.group(1)) if found else None


def split_of(module: str, mla: bool) -> Split:
    """How tensor parallelism splits ``module`` (module doc)."""
    leaf = module.rsplit(".", 1)[-1]
    if "norm" in leaf or leaf in ("gate", "router") or (mla and leaf in REPLICATED_MLA):
        return "replicated"
    if any(part in module for part in ("vision", "visual", "mm_projector", "multi_modal", "audio")):
        return "replicated"
    if not mla and leaf in ("k_proj", "v_proj"):
        return "kv"
    if leaf in ("embed_tokens", "lm_head", "wte", "output") or _recognised(module):
        return "tp"
    return "replicated"


def _recognised(module: str) -> bool:
    leaf = module.rsplit(".", 1)[-1]
    return leaf in (
        "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj",
        "down_proj", "gate_up_proj", "w1", "w2", "w3", "c_attn", "c_proj", "c_fc", "dense", "query_key_value",
        "dense_h_to_4h", "dense_4h_to_h",
    )  # fmt: skip


def module_of(tensor: str) -> str:
    head, _, tail = tensor.rpartition(".")
    return head if head and tail in TENSOR_SUFFIXES else tensor


# --- shapes from config.json ----------------------------------------------------------------------


def _int(text: Mapping[str, Any], *keys: str, default: int = 0) -> int:
    for key in keys:
        value = text.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def module_params(module: str, text: Mapping[str, Any]) -> int | None:
    """Elements of ``module``'s weight from the language model's config; None when the name is not one of
    the decoder's (a vision tower, an unknown fused module)."""
    hidden = _int(text, "hidden_size")
    heads = _int(text, "num_attention_heads")
    kv_heads = _int(text, "num_key_value_heads", default=heads)
    head_dim = _int(text, "head_dim", default=hidden // max(heads, 1))
    vocab = _int(text, "vocab_size")
    inter = _int(text, "intermediate_size")
    moe_inter = _int(text, "moe_intermediate_size", default=inter)
    shared = _int(text, "n_shared_experts", default=1)
    shared_inter = _int(text, "shared_expert_intermediate_size", default=moe_inter * shared)
    experts = _int(text, "n_routed_experts", "num_experts", "num_local_experts")
    leaf = module.rsplit(".", 1)[-1]
    if leaf in ("embed_tokens", "lm_head"):
        return vocab * hidden
    if "norm" in leaf:
        return hidden
    if is_mla(text) and ".self_attn." in module + ".":
        q_lora, kv_lora = _int(text, "q_lora_rank"), _int(text, "kv_lora_rank")
        nope, rope, v_dim = _int(text, "qk_nope_head_dim"), _int(text, "qk_rope_head_dim"), _int(text, "v_head_dim")
        return {
            "q_a_proj": hidden * q_lora,
            "q_b_proj": q_lora * heads * (nope + rope),
            "q_proj": hidden * heads * (nope + rope),
            "kv_a_proj_with_mqa": hidden * (kv_lora + rope),
            "kv_b_proj": kv_lora * heads * (nope + v_dim),
            "o_proj": heads * v_dim * hidden,
        }.get(leaf)
    attention = {
        "q_proj": hidden * heads * head_dim,
        "k_proj": hidden * kv_heads * head_dim,
        "v_proj": hidden * kv_heads * head_dim,
        "o_proj": heads * head_dim * hidden,
        "qkv_proj": hidden * (heads + 2 * kv_heads) * head_dim,
    }
    if leaf in attention:
        return attention[leaf]
    if leaf in ("gate", "router"):
        return experts * hidden
    if ".experts." in module:
        return hidden * moe_inter * (2 if leaf == "gate_up_proj" else 1) if leaf != "w2" else moe_inter * hidden
    if "shared_expert" in module:
        return hidden * shared_inter * (2 if leaf == "gate_up_proj" else 1)
    if leaf in ("gate_proj", "up_proj", "down_proj", "w1", "w3"):
        return hidden * inter
    if leaf == "gate_up_proj":
        return 2 * hidden * inter
    return None


def config_modules(text: Mapping[str, Any], prefix: str = "model.") -> list[str]:
    """The decoder's module names as a checkpoint of this config names them (for ``basis: config``)."""
    layers = _int(text, "num_hidden_layers")
    experts = _int(text, "n_routed_experts", "num_experts", "num_local_experts")
    dense_layers = _int(text, "first_k_dense_replace", default=0 if experts else layers)
    step = _int(text, "moe_layer_freq", "decoder_sparse_step", default=1) or 1
    mla = is_mla(text)
    attention = (
        (["q_a_proj", "q_a_layernorm", "q_b_proj"] if _int(text, "q_lora_rank") else ["q_proj"])
        + ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        if mla
        else ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    names = [f"{prefix}embed_tokens", f"{prefix}norm"]
    if not text.get("tie_word_embeddings", False):
        names.append("lm_head")
    for layer in range(layers):
        base = f"{prefix}layers.{layer}."
        names += [base + "input_layernorm", base + "post_attention_layernorm"]
        names += [f"{base}self_attn.{leaf}" for leaf in attention]
        if experts and layer >= dense_layers and (layer - dense_layers) % step == 0:
            names.append(base + "mlp.gate")
            names += [
                f"{base}mlp.experts.{e}.{p}" for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")
            ]
            if _int(text, "n_shared_experts", "shared_expert_intermediate_size"):
                names += [f"{base}mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        else:
            names += [f"{base}mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    return names


# --- reading the folder --------------------------------------------------------------------------


def read_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header (tensor → dtype, shape), reading only its first bytes."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100 * 1024 * 1024:
                raise CheckpointError(f"{path}: header length {length} is not a safetensors header")
            header = json.loads(handle.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header


def _header_bytes(entry: Mapping[str, Any], where: str) -> float:
    dtype = str(entry.get("dtype"))
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{where}: dtype {dtype!r} unknown")
    count = 1
    for dim in entry.get("shape") or []:
        count *= int(dim)
    return count * DTYPE_BYTES[dtype]


def _base_bytes(raw: Mapping[str, Any]) -> int:
    text = text_config(raw)
    dtype = text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    return TORCH_DTYPE_BYTES.get(str(dtype), 2)


def read_config_json(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the model folder needs its config.json)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not JSON ({exc})") from None
    if not isinstance(raw, dict) or "hidden_size" not in text_config(raw):
        raise CheckpointError(f"{path}: no 'hidden_size' at the top level or in text_config: not a model config")
    return raw


def _estimated(module: str, text: Mapping[str, Any], quant: Quantization, base: int) -> float | None:
    params = module_params(module, text)
    if params is None:
        return None
    leaf = module.rsplit(".", 1)[-1]
    quantizable = leaf not in ("embed_tokens", "gate", "router") and "norm" not in leaf and leaf != "lm_head"
    if quantizable and quant.applies(module):
        return params * quant.bytes_per_param
    return params * base


def read_weights(folder: Path | str, raw: Mapping[str, Any] | None = None) -> Weights:
    """The checkpoint's modules, from the best source the folder has (module doc)."""
    folder = Path(folder)
    raw = raw if raw is not None else read_config_json(folder)
    text = text_config(raw)
    quant = quantization_of(raw)
    base = _base_bytes(raw)
    mla = is_mla(text)
    layers = _int(text, "num_hidden_layers")
    heads = _int(text, "num_attention_heads")
    kv_heads = _int(text, "num_key_value_heads", default=heads)
    weights_of = _from_headers(folder)
    if weights_of is not None:
        by_module: dict[str, float] = {}
        fp32: dict[str, bool] = {}
        for tensor, (size, dtype) in weights_of.items():
            module = module_of(tensor)
            by_module[module] = by_module.get(module, 0.0) + size
            fp32[module] = fp32.get(module, True) and dtype == "F32"
        modules = [Module(m, _layer_of(m), split_of(m, mla), b, fp32[m]) for m, b in sorted(by_module.items())]
        return Weights(modules, "headers", sum(by_module.values()), layers, kv_heads, quant.method)
    index = _read_index(folder)
    if index is not None:
        names, total = index
        return _from_names(
            sorted({module_of(t) for t in names}),
            text,
            quant=quant,
            base=base,
            mla=mla,
            layers=layers,
            kv_heads=kv_heads,
            total=total,
        )
    names = config_modules(text, _prefix_guess(raw))
    weights = _from_names(names, text, quant=quant, base=base, mla=mla, layers=layers, kv_heads=kv_heads, total=None)
    weights.notes.append(f"{folder}: no {INDEX_FILE} or safetensors files; modules from config.json's architecture")
    return weights


def _prefix_guess(raw: Mapping[str, Any]) -> str:
    return "language_model.model." if text_config(raw) is not raw and "text_config" in raw else "model."


def _from_names(
    names: Iterable[str],
    text: Mapping[str, Any],
    *,
    quant: Quantization,
    base: int,
    mla: bool,
    layers: int,
    kv_heads: int,
    total: float | None,
) -> Weights:
    modules: list[Module] = []
    unknown: list[str] = []
    for name in names:
        size = _estimated(name, text, quant, base)
        if size is None:
            unknown.append(name)
            continue
        quantized = quant.method != "none" and quant.applies(name)
        modules.append(Module(name, _layer_of(name), split_of(name, mla), size, base == 4 and not quantized))
    known = sum(m.bytes for m in modules)
    basis: Basis = "index" if total is not None else "config"
    weights = Weights(modules, basis, known, layers, kv_heads, quant.method)
    if total is None:
        return weights
    weights.total_bytes = total
    if unknown and total > known:
        share = (total - known) / len(unknown)
        weights.modules += [Module(n, _layer_of(n), "replicated", share) for n in unknown]
        weights.notes.append(
            f"{len(unknown)} modules not in the decoder's architecture (e.g. {unknown[0]}): the index's total_size "
            f"beyond the decoder, {(total - known) / 2**30:.2f} GiB, counted replicated on every GPU"
        )
    elif known > 0:
        weights.scale = total / known
        weights.modules = [Module(m.name, m.layer, m.split, m.bytes * weights.scale, m.fp32) for m in modules]
        weights.notes.append(f"module sizes from config.json scaled ×{weights.scale:.4f} to the index's total_size")
    return weights


def _read_index(folder: Path) -> tuple[list[str], float] | None:
    path = folder / INDEX_FILE
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
        total = float((index.get("metadata") or {})["total_size"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: expected 'weight_map' and 'metadata.total_size' ({exc!r})") from None
    return list(weight_map), total


def _from_headers(folder: Path) -> dict[str, tuple[float, str]] | None:
    """Tensor → (bytes, dtype) from every shard's header; None unless every shard named by the index is here."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise CheckpointError(f"{index}: expected 'weight_map' ({exc!r})") from None
    else:
        files = [SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else []
    paths = [folder / f for f in files]
    if not paths or not all(p.is_file() for p in paths):
        return None
    sizes: dict[str, tuple[float, str]] = {}
    for path in paths:
        for tensor, entry in read_header(path).items():
            sizes[tensor] = (_header_bytes(entry, f"{path} tensor {tensor!r}"), str(entry.get("dtype")))
    return sizes
