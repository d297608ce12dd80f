"""The draft model's configuration (:class:`DrafterConfig`, what its config.json says): validated, with a
RoPE scaling every server reads alike, and derived from a target's config (:func:`drafter_config`). Why
the defaults and the YaRN form are what they are: drafter/DESIGN.md, "The draft configuration".

No torch here: the numerics are in :mod:`eagle3_pipeline.drafter.model.eagle3`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from eagle3_pipeline.drafter.spec import TrainError
from eagle3_pipeline.target.folder import is_mla


class DrafterConfigError(ValueError):
    """A draft-model configuration that cannot be built (names the field and what was expected)."""


@dataclass(frozen=True)
class DrafterConfig:
    """The draft model's fields, checked on construction: a config no server would build is refused here."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    aux_layer_ids: list[int] = field(default_factory=list)
    # EAGLE-3.1 and its relatives (see VARIANT_KEYS): all False is the plain EAGLE-3 drafter.
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    # The attention (ATTENTION_KINDS): "gqa" the Llama layer; "mla" DeepSeek's multi-head latent attention
    # (the MLA_KEYS dims, num_key_value_heads = num_attention_heads, head_dim = qk_nope + qk_rope).
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise DrafterConfigError(f"attention {self.attention!r}: expected one of {list(ATTENTION_KINDS)}")
        if self.attention == "mla":
            self._check_mla()
            return
        if any(getattr(self, key) for key in MLA_KEYS):
            raise DrafterConfigError(f"{list(MLA_KEYS)}: MLA dims belong to attention 'mla', not {self.attention!r}")
        if self.fc_norm and self.norm_before_fc:
            raise DrafterConfigError(
                "fc_norm and norm_before_fc: choose one (one RMSNorm per captured layer, or one over their "
                "concatenation); speculators refuses both together"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.aux_layer_ids) != 3:
            raise DrafterConfigError(f"aux_layer_ids: expected 3 captured target layers, got {self.aux_layer_ids}")
        rope_type = rope_kind(self.rope_scaling)
        if rope_type not in SUPPORTED_ROPE:
            raise DrafterConfigError(
                f"rope_scaling.rope_type {rope_type!r} is not supported; expected one of {sorted(SUPPORTED_ROPE)}"
            )
        if rope_type == "yarn":
            check_portable_yarn(self.rope_scaling or {})

    def _check_mla(self) -> None:
        """The MLA head as both servers build it: SGLang 0.5.23 needs ``q_lora_rank`` (its fused
        q/kv down-projection), neither server's MLA draft class has ``norm_before_fc``'s ``input_norm``,
        and their DeepSeek RoPE is YaRN or none."""
        missing = [key for key in MLA_KEYS if getattr(self, key) <= 0]
        if missing:
            raise DrafterConfigError(
                f"attention 'mla': {missing} must be positive (SGLang 0.5.23's Eagle3DeepseekV2ForCausalLM requires "
                "q_lora_rank; the others are the target's MLA dims)"
            )
        if self.norm_before_fc:
            raise DrafterConfigError(
                "norm_before_fc with attention 'mla': neither vLLM's nor SGLang's MLA draft class has input_norm; "
                "use fc_norm (EAGLE-3.1)"
            )
        if self.num_key_value_heads != self.num_attention_heads:
            raise DrafterConfigError(
                f"attention 'mla': num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
                f"({self.num_attention_heads}): every head decompresses its own key and value from the latent"
            )
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise DrafterConfigError(
                f"attention 'mla': head_dim {self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim "
                f"({self.qk_nope_head_dim + self.qk_rope_head_dim})"
            )
        if self.qk_rope_head_dim % 2:
            raise DrafterConfigError(f"qk_rope_head_dim {self.qk_rope_head_dim}: expected an even number")
        if len(self.aux_layer_ids) != 3:
            raise DrafterConfigError(f"aux_layer_ids: expected 3 captured target layers, got {self.aux_layer_ids}")
        check_deepseek_rope(self.rope_scaling, "rope_scaling")

    def to_dict(self) -> dict[str, Any]:
        """The config as a dict; the variant switches only when on and the MLA fields only for an MLA
        head, so a plain EAGLE-3 drafter's dict (a checkpoint's identity) is the one it was before they
        existed."""
        raw = asdict(self)
        dropped = {"attention", *MLA_KEYS} if self.attention == "gqa" else set()
        return {k: v for k, v in raw.items() if k not in dropped and (k not in VARIANT_KEYS or v)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DrafterConfig:
        return cls(**{**raw, "aux_layer_ids": list(raw["aux_layer_ids"])})


# The drafter variants: top-level config.json keys vLLM 0.32 and SGLang 0.5.23 read (docs/eagle3.md, "Variants,
# losses and the exported checkpoint").
VARIANT_KEYS = ("fc_norm", "norm_output", "norm_before_fc")
ATTENTION_KINDS = ("gqa", "mla")
# The MLA head's dims (DeepSeek-V2/V3 config keys), copied from the target (mla_draft_config).
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
SUPPORTED_ROPE = {"default", "linear", "llama3", "yarn"}
YARN_BETA_FAST, YARN_BETA_SLOW = 32, 1  # the servers' defaults (SGLang, vLLM, transformers)
# The (mscale, mscale_all_dim) pair every reader of a Llama config turns into YaRN's 0.1·ln(factor) + 1.
PORTABLE_MSCALE = {"mscale": 1.0, "mscale_all_dim": 0.0}
# Keys some server reads and another ignores: no value of them is served alike, so a drafter never carries them.
UNPORTABLE_YARN_KEYS = ("attn_factor", "attention_factor", "extrapolation_factor")
YARN_KEYS = {
    "rope_type",
    "type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "truncate",
    *PORTABLE_MSCALE,
}


def rope_kind(scaling: dict[str, Any] | None) -> str:
    """``rope_type`` (or legacy ``type``) of a ``rope_scaling`` dict; ``default`` for none."""
    scaling = scaling or {}
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def check_portable_yarn(scaling: dict[str, Any], where: str = "rope_scaling") -> None:
    """Refuse a Llama YaRN dict some server would read otherwise than it was trained (``where`` names it)."""
    unportable = sorted(set(scaling) & set(UNPORTABLE_YARN_KEYS))
    if unportable:
        raise DrafterConfigError(
            f"{where}: {unportable} are read by some servers and ignored by others (SGLang reads attn_factor and "
            "extrapolation_factor, vLLM attention_factor); leave them out: the drafter's YaRN attention factor is "
            "0.1·ln(factor) + 1"
        )
    unknown = sorted(set(scaling) - YARN_KEYS)
    if unknown:
        raise DrafterConfigError(f"{where}: unknown YaRN keys {unknown}; expected a subset of {sorted(YARN_KEYS)}")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise DrafterConfigError(f"{where}.{key}: required for rope_type yarn (vLLM reads it without a default)")
    if "type" in scaling and "rope_type" in scaling and scaling["type"] != scaling["rope_type"]:
        raise DrafterConfigError(f"{where}: type {scaling['type']!r} and rope_type {scaling['rope_type']!r} differ")
    for key, portable in PORTABLE_MSCALE.items():
        if key in scaling and float(scaling[key]) != portable:
            raise DrafterConfigError(
                f"{where}.{key} {scaling[key]}: servers read mscale/mscale_all_dim differently (SGLang 0.5.14 "
                f"ignores them, SGLang 0.5.23 and vLLM take a ratio); expected {portable} or none "
                "(yarn_for_servers writes the pair)"
            )


def kv_cache_elements_per_token(config: DrafterConfig) -> int:
    """What a server caches per token for the draft layer: keys and values of every KV head (GQA), or
    MLA's compressed latent plus the shared rotated key (``kv_lora_rank + qk_rope_head_dim``)."""
    if config.attention == "mla":
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * config.num_key_value_heads * config.head_dim


def attention_parameters(config: DrafterConfig) -> int:
    """The draft layer's attention weights (projections; norms left out)."""
    h, nh, hd = config.hidden_size, config.num_attention_heads, config.head_dim
    if config.attention == "mla":
        q = 2 * h * config.q_lora_rank + config.q_lora_rank * nh * hd
        kv = 2 * h * (config.kv_lora_rank + config.qk_rope_head_dim)
        kv += config.kv_lora_rank * nh * (config.qk_nope_head_dim + config.v_head_dim)
        return q + kv + nh * config.v_head_dim * h
    return 2 * h * (nh + 2 * config.num_key_value_heads) * hd + nh * hd * h


def check_deepseek_rope(scaling: dict[str, Any] | None, where: str) -> None:
    """Refuse an MLA head's RoPE that vLLM 0.32 and SGLang 0.5.23 would not read as trained: none or the
    DeepSeek YaRN (always truncated), kept in the target's form (the numerics:
    :mod:`~eagle3_pipeline.drafter.model.mla`)."""
    kind = rope_kind(scaling)
    if kind == "default":
        return
    if kind != "yarn":
        raise DrafterConfigError(f"{where}.rope_type {kind!r}: an MLA head takes the DeepSeek YaRN or none")
    scaling = scaling or {}
    unknown = sorted(set(scaling) - YARN_KEYS)
    if unknown:
        raise DrafterConfigError(f"{where}: unknown YaRN keys {unknown}; expected a subset of {sorted(YARN_KEYS)}")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise DrafterConfigError(f"{where}.{key}: required for rope_type yarn (vLLM reads it without a default)")
    if not scaling.get("truncate", True):
        raise DrafterConfigError(f"{where}.truncate false: the servers' DeepSeek YaRN always truncates")


def yarn_for_servers(scaling: dict[str, Any], where: str) -> dict[str, Any]:
    """The drafter's YaRN ``rope_scaling`` from a target's (or an override's): what the drafter trains with
    and its config.json says, read alike by SGLang 0.5.14 and 0.5.23, vLLM 0.34, transformers 5 and SpecForge
    0.2.0 (the portable mscale pair, no attention factor); an ``mscale`` other than 1 is refused, since no
    portable key expresses it. Why: drafter/DESIGN.md, "The draft configuration"."""
    raw = dict(scaling)
    if float(raw.pop("mscale", 1.0)) != 1.0:
        raise DrafterConfigError(
            f"{where}.mscale {scaling['mscale']}: a Llama drafter can be served with YaRN's attention factor "
            "0.1·ln(factor) + 1 only (mscale 1); set drafter.model.rope_scaling without mscale"
        )
    raw.pop("mscale_all_dim", None)
    raw.pop("rope_theta", None)  # transformers 5 keeps it in rope_parameters; the drafter carries it as rope_theta
    check_portable_yarn(raw, where)
    out: dict[str, Any] = {
        "rope_type": "yarn",
        "type": "yarn",
        "factor": float(raw["factor"]),
        "original_max_position_embeddings": int(raw["original_max_position_embeddings"]),
        "beta_fast": raw.get("beta_fast", YARN_BETA_FAST),
        "beta_slow": raw.get("beta_slow", YARN_BETA_SLOW),
        **PORTABLE_MSCALE,
    }
    if "truncate" in raw:
        out["truncate"] = bool(raw["truncate"])
    return out


def target_rope(target_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of a Hugging Face config, old (``rope_theta``/``rope_scaling``)
    or transformers-5 style (``rope_parameters``)."""
    params = target_config.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", target_config.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return theta, (None if rope_kind(scaling) == "default" else scaling)
    scaling = target_config.get("rope_scaling")
    return float(target_config.get("rope_theta", 10000.0)), (None if rope_kind(scaling) == "default" else scaling)


MODEL_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rope_theta", "rope_scaling", "max_position_embeddings", *VARIANT_KEYS, "attention",
)  # fmt: skip
# The Llama-style draft attention for an MLA target (mla_draft_shape): the published DeepSeek-V3 drafter's.
MLA_DRAFT_HEAD_DIM = 128
MLA_DRAFT_KV_HEADS = 8
MLA_DRAFT_INTERMEDIATE, MLA_DRAFT_HIDDEN = 40960, 7168  # intermediate at hidden 7168, scaled with the hidden size


def mla_draft_shape(hidden: int, overrides: Mapping[str, Any]) -> dict[str, int]:
    """The Llama-style head's attention and MLP for an MLA target, whose own attention is no model for a
    Llama layer: the published DeepSeek-V3 drafter's (SpecForge ``deepseek-v3-671b-eagle3.json``: head_dim
    128, hidden/128 heads, 8 KV heads, the MLP scaled with the hidden size). Sources and the alternatives
    published: drafter/DESIGN.md, "The draft configuration"."""
    head_dim = int(overrides.get("head_dim") or MLA_DRAFT_HEAD_DIM)
    heads = int(overrides.get("num_attention_heads") or max(1, hidden // head_dim))
    kv_heads = overrides.get("num_key_value_heads") or max(
        n for n in range(1, min(heads, MLA_DRAFT_KV_HEADS) + 1) if heads % n == 0
    )
    intermediate = overrides.get("intermediate_size") or 128 * -(
        -hidden * MLA_DRAFT_INTERMEDIATE // (MLA_DRAFT_HIDDEN * 128)
    )
    return {
        "head_dim": head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "intermediate_size": int(intermediate),
    }


def copied_draft_shape(target: Mapping[str, Any], hidden: int, overrides: Mapping[str, Any]) -> dict[str, int]:
    """Draft attention and MLP copied from a (GQA/MHA) target; a resized hidden divides among the heads."""
    heads = int(overrides.get("num_attention_heads") or target["num_attention_heads"])
    default_head_dim = target.get("head_dim") or int(target["hidden_size"]) // int(target["num_attention_heads"])
    return {
        "head_dim": int(
            overrides.get("head_dim") or (default_head_dim if hidden == int(target["hidden_size"]) else hidden // heads)
        ),
        "num_attention_heads": heads,
        "num_key_value_heads": int(overrides.get("num_key_value_heads") or target.get("num_key_value_heads", heads)),
        "intermediate_size": int(overrides.get("intermediate_size") or target["intermediate_size"]),
    }


def drafter_rope(
    target: Mapping[str, Any], overrides: Mapping[str, Any], mla: bool = False
) -> tuple[float, dict[str, Any] | None, int]:
    """``(rope_theta, rope_scaling, max_position_embeddings)``: the target's, or ``drafter.model``'s
    (``rope_scaling: null`` there means no scaling). A YaRN scaling is rewritten by
    :func:`yarn_for_servers` so every server reads it as trained; an MLA head (``mla``) keeps the
    DeepSeek form, which both servers' MLA classes read alike (:func:`check_deepseek_rope`). The
    drafter serves at least the target's context: a smaller ``max_position_embeddings`` is refused."""
    theta, scaling = target_rope(dict(target))
    where = "target config rope_scaling"
    if overrides.get("rope_theta") is not None:
        theta = float(overrides["rope_theta"])
    if "rope_scaling" in overrides:
        scaling, where = overrides["rope_scaling"], "drafter.model.rope_scaling"
    if rope_kind(scaling) == "default":
        scaling = None
    elif mla:  # transformers 5 may keep rope_theta in the scaling dict; the drafter carries it apart
        scaling = {k: v for k, v in (scaling or {}).items() if k != "rope_theta"}
        check_deepseek_rope(scaling, where)
        scaling |= {"rope_type": "yarn", "type": "yarn"}
    elif rope_kind(scaling) == "yarn":
        scaling = yarn_for_servers(dict(scaling or {}), where)
    target_positions = int(target.get("max_position_embeddings", 4096))
    positions = int(overrides.get("max_position_embeddings") or target_positions)
    if positions < target_positions:
        raise TrainError(
            f"drafter.model.max_position_embeddings {positions}: expected at least the target's {target_positions} "
            "(the server drafts at every position the target serves)"
        )
    return theta, scaling, positions


def drafter_config(
    target: Mapping[str, Any], draft_vocab_size: int, aux_layer_ids: list[int], overrides: Mapping[str, Any]
) -> DrafterConfig:
    """The draft model for ``target``, the language model's config as a flat dict (a nested
    ``text_config`` resolved). Hidden size, vocabulary, norm epsilon, RoPE and context are the
    target's; attention and MLP are the target's too (:func:`copied_draft_shape`) except for an MLA
    target (:func:`mla_draft_shape`). Every default yields to ``drafter.model.*`` (``overrides``; a key
    given as None counts as left out, except ``rope_scaling``)."""
    unknown = sorted(set(overrides) - set(MODEL_KEYS))
    if unknown:
        raise TrainError(f"drafter.model: unknown keys {unknown}; expected a subset of {list(MODEL_KEYS)}")
    hidden = int(overrides.get("hidden_size") or target["hidden_size"])
    if (overrides.get("attention") or "gqa") == "mla":
        return mla_draft_config(target, hidden, draft_vocab_size, aux_layer_ids, overrides)
    shape = mla_draft_shape(hidden, overrides) if is_mla(target) else copied_draft_shape(target, hidden, overrides)
    return DrafterConfig(
        **_shared_fields(target, hidden, draft_vocab_size, aux_layer_ids, overrides, mla=False),
        intermediate_size=shape["intermediate_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
    )


def _shared_fields(
    target: Mapping[str, Any],
    hidden: int,
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    overrides: Mapping[str, Any],
    *,
    mla: bool,
) -> dict[str, Any]:
    """The fields both draft heads take alike: sizes, vocabularies, norm epsilon, RoPE, captured layers and the
    EAGLE-3.1 switches."""
    theta, scaling, positions = drafter_rope(target, overrides, mla=mla)
    return {
        "hidden_size": hidden,
        "target_hidden_size": int(target["hidden_size"]),
        "vocab_size": int(target["vocab_size"]),
        "draft_vocab_size": draft_vocab_size,
        "rms_norm_eps": float(target.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": positions,
        "aux_layer_ids": list(aux_layer_ids),
        **{key: bool(overrides.get(key, False)) for key in VARIANT_KEYS},
    }


def mla_draft_config(
    target: Mapping[str, Any],
    hidden: int,
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    overrides: Mapping[str, Any],
) -> DrafterConfig:
    """The MLA draft head (``drafter.model.attention: mla``) for a DeepSeek-V2/V3 or Kimi target: the
    target's MLA dims (q/kv LoRA ranks, nope/rope/v head dims), heads and dense MLP width
    (``intermediate_size``, its first dense layer's), its DeepSeek RoPE as is. A target without MLA
    dims, or a ``head_dim``/``num_key_value_heads`` override (MLA's are fixed by its dims), is refused."""
    missing = [key for key in MLA_KEYS if not target.get(key)]
    if missing and missing != ["q_lora_rank"]:
        raise TrainError(
            f"drafter.model.attention: mla needs a target with DeepSeek MLA dims; its config has no {missing} "
            f"(model_type {target.get('model_type')!r}); use attention: gqa"
        )
    if missing:
        raise TrainError(
            "drafter.model.attention: mla: the target has no q_lora_rank (an uncompressed query, as DeepSeek-V2-Lite); "
            "SGLang 0.5.23's Eagle3DeepseekV2ForCausalLM requires one; use attention: gqa"
        )
    fixed = sorted(key for key in ("head_dim", "num_key_value_heads") if overrides.get(key))
    if fixed:
        raise TrainError(f"drafter.model {fixed}: not settable with attention: mla (the MLA dims fix them)")
    heads = int(overrides.get("num_attention_heads") or target["num_attention_heads"])
    dims = {key: int(target[key]) for key in MLA_KEYS}
    return DrafterConfig(
        **_shared_fields(target, hidden, draft_vocab_size, aux_layer_ids, overrides, mla=True),
        intermediate_size=int(overrides.get("intermediate_size") or target["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"],
        attention="mla",
        q_lora_rank=dims["q_lora_rank"],
        kv_lora_rank=dims["kv_lora_rank"],
        qk_nope_head_dim=dims["qk_nope_head_dim"],
        qk_rope_head_dim=dims["qk_rope_head_dim"],
        v_head_dim=dims["v_head_dim"],
    )
