"""The one target loader: every phase reads the target model through this module.

A target ships as it ships: remote code, a vision-language wrapper with the language model's config
nested in ``text_config`` (Kimi-K2.5), weights under a prefix split over many shards, a slow
tokenizer, weights the local path cannot execute (compressed-tensors INT4). This module resolves the
language model's config (:func:`text_config`, :func:`dimensions`), passes ``target.trust_remote_code``
to every transformers call, reads tensors by name from only the shards that hold them
(:func:`read_tensors`), and refuses a checkpoint the local path cannot execute before loading it
(:func:`check_local_executable`). torch, transformers and safetensors are imported inside the
functions that use them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TRUST_SETTING = "target.trust_remote_code"
# Keys under which multimodal wrappers keep their language model's config, in the order tried.
NESTED_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
# Model types whose attention is MLA (DeepSeek-V2/V3 and the Kimi models built on them).
MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25"})
# Where the local path's refusal points (the serving stack holds what transformers on one machine cannot).
OTHER_BACKENDS = (
    "extract on the serving stack instead (SGLang with tensor parallelism or vLLM's hidden-state "
    "extraction), or import states made there (hidden_states compute.kind: command)"
)


class TargetError(ValueError):
    """The target cannot be read or loaded; the message names the setting, file or field."""


@dataclass(frozen=True)
class TargetDimensions:
    """The language model's dimensions, wherever the checkpoint keeps them."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    mla: bool


def _is_local(model: str) -> bool:
    return Path(model).exists()


def config_path(model: str) -> Path:
    """The target's ``config.json``: in a local folder, or in the Hugging Face cache for an id."""
    if _is_local(model):
        path = Path(model) / "config.json"
        if not path.is_file():
            raise TargetError(f"{path}: no config.json; the target must be a model folder with its config.json")
        return path
    from transformers.utils.hub import cached_file

    try:
        found = cached_file(model, "config.json")
    except OSError as exc:
        raise TargetError(f"target model {model!r}: no config.json ({exc})") from None
    if found is None:
        raise TargetError(f"target model {model!r}: no config.json")
    return Path(found)


def read_config(model: str) -> dict[str, Any]:
    """The target's ``config.json`` as it ships (outer config, nested configs included)."""
    path = config_path(model)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TargetError(f"{path}: not a JSON config ({exc})") from None
    if not isinstance(raw, dict):
        raise TargetError(f"{path}: expected a JSON object")
    return raw


def config_sha256(model: str) -> str:
    """SHA-256 of the target's ``config.json`` bytes: part of every store's identity."""
    return hashlib.sha256(config_path(model).read_bytes()).hexdigest()


def text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: the nested ``text_config`` (or ``language_config`` /
    ``llm_config``) of a multimodal wrapper, else the config itself. Keys the wrapper sets at the
    top level that the nested one lacks (``tie_word_embeddings``, token ids) are carried over."""
    for key in NESTED_CONFIG_KEYS:
        nested = raw.get(key)
        if isinstance(nested, dict) and "hidden_size" in nested:
            inherited = {
                k: raw[k] for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id") if k in raw
            }
            return {**inherited, **nested}
    return dict(raw)


def _required(config: Mapping[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TargetError(
            f"{where}: field {key!r} is missing or not an integer (expected it in the language model's config)"
        )
    return value


def dimensions(raw: Mapping[str, Any], where: str = "config.json") -> TargetDimensions:
    """The language model's dimensions from a (possibly nested) ``config.json``."""
    text = text_config(raw)
    nested = text is not raw and any(isinstance(raw.get(k), dict) for k in NESTED_CONFIG_KEYS)
    at = f"{where} ({'text_config' if nested else 'top level'})"
    heads = _required(text, "num_attention_heads", at)
    model_type = str(text.get("model_type") or raw.get("model_type") or "")
    return TargetDimensions(
        model_type=model_type,
        num_layers=_required(text, "num_hidden_layers", at),
        hidden_size=_required(text, "hidden_size", at),
        vocab_size=_required(text, "vocab_size", at),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        intermediate_size=_required(text, "intermediate_size", at),
        max_position_embeddings=int(text.get("max_position_embeddings") or 0),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        mla=is_mla(text),
    )


def is_mla(text: Mapping[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2/K2.5): a low-rank KV projection."""
    return bool(text.get("kv_lora_rank")) or str(text.get("model_type", "")) in MLA_MODEL_TYPES


def needs_remote_code(raw: Mapping[str, Any]) -> bool:
    """The checkpoint names its own Python classes (``auto_map``). They are what the serving stack
    runs with ``--trust-remote-code``; transformers may also have a native class of the same
    ``model_type`` (5.x has one for ``kimi_k25``) that is not the shipped code, so the choice is the
    user's, never a silent fallback."""
    return bool(raw.get("auto_map"))


def check_remote_code(model: str, raw: Mapping[str, Any], trust_remote_code: bool) -> None:
    if needs_remote_code(raw) and not trust_remote_code:
        raise TargetError(
            f"target model {model!r} (model_type {raw.get('model_type')!r}) ships its own code (auto_map in "
            f"config.json); set {TRUST_SETTING}: true to run that code"
        )


def load_config(model: str, trust_remote_code: bool = False) -> Any:
    """transformers' config object (remote code only with ``trust_remote_code``)."""
    from transformers import AutoConfig

    check_remote_code(model, read_config(model), trust_remote_code)
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        raise TargetError(
            f"target model {model!r}: transformers cannot read its config ({type(exc).__name__}: {exc})"
        ) from None


def load_tokenizer(name: str, trust_remote_code: bool = False, setting: str = "target.tokenizer") -> Any:
    """The target's tokenizer, fast or slow (Kimi's ``TikTokenTokenizer`` is slow and remote code)."""
    from transformers import AutoTokenizer

    local_config = Path(name) / "tokenizer_config.json"
    if local_config.is_file() and not trust_remote_code:
        try:
            auto_map = json.loads(local_config.read_text()).get("auto_map") or {}
        except (OSError, json.JSONDecodeError):
            auto_map = {}
        if auto_map.get("AutoTokenizer"):
            raise TargetError(
                f"{setting} {name!r}: the tokenizer ships its own code (auto_map in tokenizer_config.json); "
                f"set {TRUST_SETTING}: true to run that code"
            )
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError, KeyError) as exc:
        hint = f"; if it ships its own code, set {TRUST_SETTING}: true" if not trust_remote_code else ""
        raise TargetError(
            f"{setting} {name!r}: cannot load the tokenizer ({type(exc).__name__}: {exc}){hint}"
        ) from None
    return tokenizer


# --- weights by name -------------------------------------------------------------------------------


def _weight_map(folder: Path) -> dict[str, str] | None:
    index = folder / INDEX_FILE
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, json.JSONDecodeError) as exc:
        raise TargetError(f"{index}: not a safetensors index ({exc})") from None
    if not isinstance(weight_map, dict):
        raise TargetError(f"{index}: field 'weight_map' is missing")
    return {str(k): str(v) for k, v in weight_map.items()}


def tensor_names(folder: Path) -> list[str]:
    """Every tensor name of the checkpoint: from its index, or the header of its one file."""
    folder = Path(folder)
    weight_map = _weight_map(folder)
    if weight_map is not None:
        return sorted(weight_map)
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise TargetError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return sorted(handle.keys())


def weight_prefix(folder: Path) -> str:
    """The prefix the language model's weights carry: '' for a bare causal LM (``model.…``,
    ``lm_head.weight``), ``language_model.`` for Kimi-K2.5, whatever the index says otherwise."""
    names = tensor_names(folder)
    suffix = "model.embed_tokens.weight"
    found = sorted((n[: -len(suffix)] for n in names if n.endswith(suffix)), key=len)
    if not found:
        raise TargetError(
            f"{folder}: no tensor named '…{suffix}' in the checkpoint; cannot find the language model's weights"
        )
    return found[0]


def checkpoint_bytes(folder: Path) -> int:
    """Bytes of the checkpoint's weight files (the index's ``total_size`` when it has one)."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        total = (json.loads(index.read_text()).get("metadata") or {}).get("total_size")
        if isinstance(total, int):
            return total
        files = set((_weight_map(folder) or {}).values())
        return sum((folder / f).stat().st_size for f in files if (folder / f).is_file())
    single = folder / SINGLE_FILE
    return single.stat().st_size if single.is_file() else 0


def read_tensors(folder: Path, names: Iterable[str]) -> dict[str, Any]:
    """The named tensors, each read from the shard that holds it; no other shard is opened and no
    other tensor is read."""
    from safetensors import safe_open

    folder = Path(folder)
    wanted = list(dict.fromkeys(names))
    weight_map = _weight_map(folder)
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        if weight_map is not None:
            if name not in weight_map:
                raise TargetError(f"{folder / INDEX_FILE}: no tensor {name!r} in weight_map")
            path = folder / weight_map[name]
        else:
            path = folder / SINGLE_FILE
            if not path.is_file():
                raise TargetError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE}")
        by_file.setdefault(path, []).append(name)
    out: dict[str, Any] = {}
    for path, keys in by_file.items():
        if not path.is_file():
            raise TargetError(f"{path}: missing (named by {INDEX_FILE})")
        with safe_open(str(path), framework="pt") as handle:
            present = set(handle.keys())
            for key in keys:
                if key not in present:
                    raise TargetError(f"{path}: no tensor {key!r}")
                out[key] = handle.get_tensor(key)
    return out


# --- the model, for the local (transformers) extraction path --------------------------------------


def quantization(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's quantization config (outer or nested), if any."""
    for config in (raw, text_config(raw)):
        found = config.get("quantization_config")
        if isinstance(found, dict):
            return found
    return None


def available_memory_bytes() -> int:
    """Memory this process may use: MemAvailable, capped by a cgroup limit when one is set."""
    available = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            available = min(available, int(text))
    return available


def check_local_executable(
    model: str, raw: Mapping[str, Any], device: str, dtype_bytes: int, memory_bytes: int
) -> None:
    """Refuse, before loading anything, a checkpoint that transformers cannot run here: quantized
    weights without the kernels for them on this device (compressed-tensors INT4 on CPU), or a
    model larger than the memory it would be loaded into."""
    quant = quantization(raw)
    if quant is not None and device == "cpu":
        method = quant.get("quant_method", "unknown")
        raise TargetError(
            f"target model {model!r} is quantized ({method}); the local transformers extraction runs on the CPU here "
            f"and cannot execute quantized weights: {OTHER_BACKENDS}"
        )
    if not _is_local(model):
        return
    on_disk = checkpoint_bytes(Path(model))
    dims = dimensions(raw, str(Path(model) / "config.json"))
    stored = 2 if quant is None else 1  # bytes per stored weight (bf16 checkpoints; quantized ones less)
    needed = on_disk * dtype_bytes // stored if on_disk else 0
    if needed and needed > memory_bytes:
        raise TargetError(
            f"target model {model!r} ({dims.num_layers} layers, hidden {dims.hidden_size}): about "
            f"{needed / 1e9:.1f} GB in {'float32' if dtype_bytes == 4 else 'bfloat16'}, more than the "
            f"{memory_bytes / 1e9:.1f} GB this machine can give it; {OTHER_BACKENDS}"
        )


def load_causal_lm(model: str, trust_remote_code: bool, dtype: str, device: str) -> Any:
    """The target as a transformers causal LM (``device``: ``cpu`` or ``cuda``; ``dtype``: a torch
    dtype name), after the refusals above; remote code only with ``trust_remote_code``."""
    import torch
    from transformers import AutoModelForCausalLM

    raw = read_config(model)
    check_remote_code(model, raw, trust_remote_code)
    dtype_bytes = torch.finfo(getattr(torch, dtype)).bits // 8
    if device == "cpu":
        check_local_executable(model, raw, device, dtype_bytes, available_memory_bytes())
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "trust_remote_code": trust_remote_code}
    if device == "cuda":
        kwargs["device_map"] = "auto"
    try:
        loaded = AutoModelForCausalLM.from_pretrained(model, **kwargs)
    except (OSError, ValueError, ImportError, KeyError) as exc:
        raise TargetError(
            f"target model {model!r}: cannot load it with transformers ({type(exc).__name__}: {exc})"
        ) from None
    return loaded.eval()


def language_model(model: Any) -> Any:
    """The causal LM inside a wrapper (Kimi-K2.5's ``language_model``), else the model itself."""
    inner = getattr(model, "language_model", None)
    return inner if inner is not None and hasattr(inner, "lm_head") else model


def decoder(model: Any) -> Any:
    """The decoder stack (the module with ``layers`` and the final ``norm``) of a causal LM."""
    lm = language_model(model)
    stack = getattr(lm, "model", None)
    if stack is None or getattr(stack, "layers", None) is None:
        stack = getattr(lm, "base_model", None)
    if stack is None or getattr(stack, "layers", None) is None:
        raise TargetError(f"{type(model).__name__}: no decoder layer list (model.layers); cannot capture aux states")
    return stack


# --- what the drafter needs from the target ----------------------------------------------------------


@dataclass(frozen=True)
class DrafterTensorNames:
    embedding: str
    lm_head: str  # the embedding's name when the target ties them
    norm: str


def drafter_tensor_names(
    folder: Path, embedding_key: str | None = None, lm_head_key: str | None = None
) -> DrafterTensorNames:
    """The checkpoint names of the input embedding, ``lm_head`` and final norm: as set, else under
    the detected prefix (``lm_head`` falls back to the embedding when the target ties them)."""
    folder = Path(folder)
    prefix = weight_prefix(folder)
    embedding = embedding_key or f"{prefix}model.embed_tokens.weight"
    if lm_head_key:
        lm_head = lm_head_key
    else:
        tied = dimensions(read_config(str(folder)), str(folder / "config.json")).tie_word_embeddings
        names = set(tensor_names(folder))
        lm_head = f"{prefix}lm_head.weight"
        if lm_head not in names and tied:
            lm_head = embedding
    return DrafterTensorNames(embedding, lm_head, f"{prefix}model.norm.weight")
