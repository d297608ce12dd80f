"""Warm start (``drafter.init_from``): the drafter starts from an existing EAGLE-3 export instead of a
seeded initialisation, e.g. a public drafter adapted to one's own traffic.

Read: the folder's ``config.json`` in our export's form, SpecForge's (the same
``LlamaForCausalLMEagle3`` config; TorchSpec writes it too) or speculators' nested one
(``speculators_model_type: eagle3``, :mod:`eagle3_pipeline.drafter.export.speculators`); the MLA draft head's
(``Eagle3DeepseekV2ForCausalLM``: ours, TorchSpec's ``deepseek_eagle.py`` and lightseek's, whose
config may carry only SGLang's ``eagle_config`` layer ids: read as trained when SGLang's DeepSeek rule
and ours agree, the first id 1); and its weights (``model.safetensors``, else ``pytorch_model.bin``
loaded with ``weights_only``). Parameter names are mapped onto ours: SpecForge's and TorchSpec's
``midlayer.*`` are ours, speculators' decoder layer and the one SGLang's and vLLM's MLA loaders also take
is ``layers.0.*`` (``transformer.*`` in speculators' first releases). The draft vocabulary comes from
the weights' ``d2t``/``t2d``, or is the full target vocabulary (``draft_vocab_size == vocab_size`` and
no ``d2t``).

The start must be the drafter this run builds: the attention (an MLA start for a GQA run, or the
reverse, is refused naming both), the target's hidden and vocabulary sizes, the captured layers, the
head dimensions (an MLA head's LoRA ranks and nope/rope/v dims too), RoPE (``rope_theta`` and each
``rope_scaling`` value, YaRN's defaults filled in so equal settings written differently agree) and the
variant switches; anything else is refused naming the file, the field and the setting that decides it.
A start with the run's draft-vocabulary size but other tokens (made from other traffic), or with the
full vocabulary, gives its ``lm_head`` row of every target token both vocabularies hold; rows of tokens
new to the run keep their seeded initialisation. The target's embedding stays the run's (frozen) when
the draft hidden size is the target's.

The start's content digest (:attr:`WarmStart.digest`) is part of the run's identity, so a changed start
is never resumed from checkpoints of another; the start weights are the anchor of the optional L2-SP
pull (:func:`l2sp_penalty`, ``drafter.init_l2sp``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.drafter.export.formats import ARCHITECTURE, CONFIG_FILE, MLA_ARCHITECTURE, WEIGHTS_FILE
from eagle3_pipeline.drafter.export.specforge import config_from_export
from eagle3_pipeline.drafter.export.speculators import config_from_speculators, is_speculators_config
from eagle3_pipeline.drafter.model.draft_config import (
    MLA_KEYS,
    VARIANT_KEYS,
    YARN_BETA_FAST,
    YARN_BETA_SLOW,
    DrafterConfig,
    DrafterConfigError,
    rope_kind,
)
from eagle3_pipeline.drafter.model.eagle3 import Eagle3Drafter
from eagle3_pipeline.drafter.spec import TrainError

BIN_FILE = "pytorch_model.bin"
LAYER_PREFIXES = ("layers.0.", "transformer.")  # speculators' decoder layer, now and in its first releases
OUR_LAYER = "midlayer."
# Field -> what decides it in this run, for the refusal's hint.
DECIDED_BY = {
    "target_hidden_size": "the target's hidden size",
    "vocab_size": "the target's vocabulary",
    "aux_layer_ids": "hidden_states.aux_layer_ids (the captured target layers)",
    "hidden_size": "drafter.model.hidden_size",
    "intermediate_size": "drafter.model.intermediate_size",
    "num_attention_heads": "drafter.model.num_attention_heads",
    "num_key_value_heads": "drafter.model.num_key_value_heads",
    "head_dim": "drafter.model.head_dim",
    "draft_vocab_size": "draft_vocab.size",
    **{key: f"the target's {key} (drafter.model.attention: mla copies it)" for key in MLA_KEYS},
    **{key: f"drafter.model.{key}" for key in VARIANT_KEYS},
}
ROPE_DECIDED_BY = "the target's RoPE, or drafter.model.rope_theta / drafter.model.rope_scaling"
# What a missing YaRN key means to every reader (vLLM, SGLang, TorchSpec, our mla.py and model.py).
YARN_DEFAULTS = {"beta_fast": YARN_BETA_FAST, "beta_slow": YARN_BETA_SLOW, "mscale": 1, "mscale_all_dim": 0,
                 "truncate": True}  # fmt: skip
HEADS = {"gqa": f"a GQA (Llama-style, {ARCHITECTURE})", "mla": f"an MLA ({MLA_ARCHITECTURE})"}


class WarmStartError(TrainError):
    """A ``drafter.init_from`` folder this run cannot start from; the message names the file and field."""


@dataclass(frozen=True)
class WarmStart:
    """The start, read and checked: its weights under our names for this run's model (``lm_head``
    mapped onto the run's draft vocabulary), where it came from and how much of ``lm_head`` it gave."""

    folder: Path
    format: str  # "pipeline/specforge" (LlamaForCausalLMEagle3), "pipeline/torchspec (mla)" or "speculators"
    digest: str
    weights: dict[str, torch.Tensor]
    lm_head_rows: int  # rows of the run's lm_head the start gave (the others keep their seeded init)

    def describe(self) -> dict[str, Any]:
        return {"from": str(self.folder), "format": self.format, "digest": self.digest[:16],
                "lm_head_rows": self.lm_head_rows}  # fmt: skip

    def apply(self, model: Eagle3Drafter) -> None:
        """Load the start into ``model`` (a freshly built one: the rows the start lacks keep its init)."""
        model.load_state_dict(self.weights, strict=False)

    def anchor(self, model: Eagle3Drafter) -> dict[str, torch.Tensor]:
        """θ₀ of every trained parameter, on the model's device (the L2-SP anchor)."""
        return {
            name: self.weights[name].to(param.device, torch.float32)
            for name, param in model.named_parameters()
            if param.requires_grad and name in self.weights
        }


def content_digest(folder: Path) -> str:
    """sha256 over the config and weights files' names and bytes: a changed start is another start."""
    digest = hashlib.sha256()
    for path in (folder / CONFIG_FILE, weights_path(folder)):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def weights_path(folder: Path) -> Path:
    for name in (WEIGHTS_FILE, BIN_FILE):
        if (folder / name).is_file():
            return folder / name
    raise WarmStartError(f"drafter.init_from {folder}: no {WEIGHTS_FILE} or {BIN_FILE} (a single-file export)")


def start_config(folder: Path) -> tuple[DrafterConfig, str]:
    """The start's model config and its format, from ``config.json`` in any of the read layouts."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise WarmStartError(f"drafter.init_from {folder}: no {CONFIG_FILE} (an EAGLE-3 export folder)")
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise WarmStartError(f"{path}: not JSON ({exc})") from None
    variants = {key: bool(raw.get(key, False)) for key in VARIANT_KEYS}
    variants["norm_before_fc"] = bool((raw.get("eagle_config") or {}).get("norm_before_fc", variants["norm_before_fc"]))
    try:
        if is_speculators_config(raw):
            return replace(config_from_speculators(raw, path), **variants), "speculators"
        if raw.get("architectures") == [MLA_ARCHITECTURE]:
            return config_from_export(mla_start_config(raw, path)), "pipeline/torchspec (mla)"
        if raw.get("architectures") != [ARCHITECTURE]:
            raise WarmStartError(
                f"{path}: architectures is {raw.get('architectures')}; a warm start reads an EAGLE-3 drafter "
                f"([{ARCHITECTURE!r}], [{MLA_ARCHITECTURE!r}] or speculators' Eagle3Speculator)"
            )
        return config_from_export(raw), "pipeline/specforge"
    except KeyError as exc:
        raise WarmStartError(f"{path}: missing {exc.args[0]!r}") from None
    except DrafterConfigError as exc:
        raise WarmStartError(f"{path}: {exc}") from None


def mla_start_config(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """An MLA head's config.json as ours reads it: its MLA dims present (``q_lora_rank`` a number: both
    servers' MLA draft classes need the compressed query), and TorchSpec's SGLang-only layer ids
    (``eagle_config``) as vLLM's, when they mean the trained layers in every SGLang release (first id 1)."""
    missing = [key for key in MLA_KEYS if not isinstance(raw.get(key), int)]
    if missing:
        raise WarmStartError(
            f"{path}: {missing} must be numbers for an {MLA_ARCHITECTURE} start (q_lora_rank null is an "
            "uncompressed query, which SGLang 0.5.23's class cannot load and this pipeline does not train)"
        )
    if "eagle_aux_hidden_state_layer_ids" in raw:
        return raw
    sglang = list((raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [])
    if not sglang:
        raise KeyError("eagle_aux_hidden_state_layer_ids")
    if sglang[0] != 1:
        raise WarmStartError(
            f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids {sglang} without vLLM's top-level ids: SGLang "
            "reads a DeepSeek-family first id other than 1 differently per release, so the trained layers are "
            "unknown; add eagle_aux_hidden_state_layer_ids (input-of-layer ids, as vLLM reads them)"
        )
    return {**raw, "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in sglang]}


def rope_fields(config: DrafterConfig) -> dict[str, Any]:
    """The RoPE a drafter computes, comparable across writers: ``rope_theta`` and each ``rope_scaling``
    value but its type keys, YaRN's missing ones as every reader defaults them, numbers as floats."""
    kind = rope_kind(config.rope_scaling)
    out: dict[str, Any] = {"rope_theta": float(config.rope_theta), "rope_scaling.rope_type": kind}
    if kind == "default":
        return out
    values = {**(YARN_DEFAULTS if kind == "yarn" else {}), **(config.rope_scaling or {})}
    for key, value in sorted(values.items()):
        if key not in ("rope_type", "type"):
            number = isinstance(value, int | float) and not isinstance(value, bool)
            out[f"rope_scaling.{key}"] = float(value) if number else value
    return out


def check_against(start: DrafterConfig, run: DrafterConfig, path: Path) -> None:
    """Refuse a start that is not this run's drafter, every differing field named at once. A start
    with the full vocabulary fits any draft vocabulary (its rows are picked)."""
    if start.attention != run.attention:
        raise WarmStartError(
            f"{path}: the start is {HEADS[start.attention]} draft head, this run trains {HEADS[run.attention]} "
            f"one (drafter.model.attention: {run.attention}); set drafter.model.attention: {start.attention} "
            "to start from it, or start from a drafter with this run's attention"
        )
    full = start.draft_vocab_size == start.vocab_size
    differ = [
        f"{field} is {getattr(start, field)}, this run's is {getattr(run, field)} ({decided})"
        for field, decided in DECIDED_BY.items()
        if getattr(start, field) != getattr(run, field) and not (field == "draft_vocab_size" and full)
    ]
    theirs, ours = rope_fields(start), rope_fields(run)
    differ += [
        f"{key} is {theirs.get(key)}, this run's is {ours.get(key)} ({ROPE_DECIDED_BY})"
        for key in {**ours, **theirs}
        if theirs.get(key) != ours.get(key)
    ]
    if differ:
        raise WarmStartError(f"{path}: the start is not the drafter this run trains: " + "; ".join(differ))


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The weights file's tensors under our names (float32 for the floating ones)."""
    if path.name == BIN_FILE:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    else:
        from safetensors.torch import load_file

        loaded = load_file(str(path))
    if not isinstance(loaded, dict):
        raise WarmStartError(f"{path}: expected a state dict of tensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in loaded.items():
        for prefix in LAYER_PREFIXES:
            if name.startswith(prefix):
                name = OUR_LAYER + name[len(prefix) :]
        out[name] = tensor.float() if tensor.is_floating_point() else tensor
    return out


def lm_head_rows(
    start: torch.Tensor, start_ids: torch.Tensor, fresh: torch.Tensor, run_ids: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, int]:
    """The run's lm_head: for each run draft id, the start's row of the same target token, else ``fresh``'s."""
    where = torch.full((vocab,), -1, dtype=torch.int64)
    where[start_ids] = torch.arange(start_ids.shape[0])
    source = where[run_ids]
    held = source >= 0
    out = fresh.detach().clone().float()
    out[held] = start[source[held]]
    return out, int(held.sum())


def read_start(folder: Path, model: Eagle3Drafter) -> WarmStart:
    """The start in ``folder`` read for ``model`` (this run's freshly built drafter: its config, draft
    vocabulary and seeded lm_head), checked against it."""
    folder = Path(folder)
    config, kind = start_config(folder)
    check_against(config, model.config, folder / CONFIG_FILE)
    path = weights_path(folder)
    tensors = read_weights(path)
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)  # d2t says the same
    if d2t is None and config.draft_vocab_size != config.vocab_size:
        raise WarmStartError(
            f"{path}: no d2t, and draft_vocab_size {config.draft_vocab_size} is not the full vocabulary "
            f"{config.vocab_size}: the start's lm_head rows cannot be matched to tokens"
        )
    start_ids = torch.arange(config.draft_vocab_size) + (0 if d2t is None else d2t.to(torch.int64))
    run_ids = torch.arange(model.config.draft_vocab_size) + model.d2t.cpu()
    own = model.state_dict()
    if "lm_head.weight" in tensors:
        tensors["lm_head.weight"], rows = lm_head_rows(
            tensors["lm_head.weight"], start_ids, own["lm_head.weight"].cpu(), run_ids, config.vocab_size
        )
    else:
        rows = 0
    if model.embedding_frozen:
        tensors.pop("embed_tokens.weight", None)  # the run's is the target's
    expected = {name for name in own if name not in ("d2t", "t2d") and not (
        name == "embed_tokens.weight" and model.embedding_frozen)}  # fmt: skip
    unknown, missing = sorted(set(tensors) - expected), sorted(expected - set(tensors))
    if unknown or missing:
        raise WarmStartError(
            f"{path}: the weights are not this drafter's: "
            + "; ".join(part for part in (
                f"unknown {unknown[:8]}" if unknown else "", f"missing {missing[:8]}" if missing else "") if part)
        )  # fmt: skip
    wrong = [
        f"{name} {tuple(t.shape)} (expected {tuple(own[name].shape)})"
        for name, t in tensors.items()
        if t.shape != own[name].shape
    ]
    if wrong:
        raise WarmStartError(f"{path}: tensor shapes differ from the config's: {', '.join(wrong[:8])}")
    return WarmStart(folder, kind, content_digest(folder), tensors, rows)


def l2sp_penalty(model: Eagle3Drafter, anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """Σ‖θ − θ₀‖² over the anchored parameters (L2-SP, Li et al. 2018): 0 at the start."""
    params = dict(model.named_parameters())
    total = torch.zeros((), device=next(iter(params.values())).device)
    for name, start in anchor.items():
        total = total + (params[name].float() - start).pow(2).sum()
    return total
