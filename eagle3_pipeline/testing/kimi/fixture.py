"""A tiny random-weight checkpoint shaped like Kimi-K2.5, built by the tests (nothing downloaded).

Kimi-K2.5 (1T parameters, 61 layers, hidden 7168, 384 routed experts, vocab 163,840) is the
target this pipeline trains EAGLE-3 drafters for; :func:`build_kimi_checkpoint` writes a folder
that loads through the same doors the real one does, at a size the CPU tests can run.

Faithful to the real checkpoint:

* ``config.json``: ``model_type: kimi_k25``, ``architectures: [KimiK25ForConditionalGeneration]``,
  ``auto_map`` to remote code (``configuration_kimi_k25.py``, ``modeling_kimi_k25.py``; the
  checkpoint's own classes load only with ``trust_remote_code=True``), no dimensions at the top
  level, a nested
  DeepSeek-V3 ``text_config`` with MLA (q/kv LoRA ranks, nope/rope/v head dims), MoE (routed +
  shared experts, sigmoid ``noaux_tc`` routing, first layer dense), YaRN (factor 64, θ 50000,
  original 4096, 262,144 positions) and ``torch_dtype: bfloat16``;
* weights prefixed ``language_model.`` (``language_model.model.embed_tokens.weight``,
  ``language_model.lm_head.weight``, per-expert ``mlp.experts.E.*_proj.weight``), bfloat16
  (the router bias ``e_score_correction_bias`` float32, as DeepSeek-V3 checkpoints keep it), in
  sharded safetensors with ``model.safetensors.index.json``;
* the slow remote-code tiktoken tokenizer (``tokenization_kimi.py``, ``TikTokenTokenizer``, a
  ``tiktoken.model`` rank file, no ``tokenizer.json``) with Kimi's special-token names and their
  positions in the 256 reserved slots after the ranks (``<think>``/``</think>`` at slots 22/23,
  i.e. 163606/163607 in the real vocabulary), ``[UNK]``/``[PAD]`` in the last two slots;
* the K2.5 chat template (``chat_template.jinja``, also in ``tokenizer_config.json``): no default
  system prompt, TypeScript tool declarations in a ``tool_declare`` turn, reasoning kept only
  after the last assistant message without tool calls, ``<think>`` prefilled by the generation
  prompt (``<think></think>`` with ``thinking=False``); it renders exactly as the K2.5 template
  that radixark/miles bundles (``kimi_k25_fixed.jinja`` with ``preserve_thinking`` off);
* ``int4=True``: the compressed-tensors ``quantization_config`` that moonshotai/Kimi-K2.5 itself
  ships (the release is INT4; the default variant is the bf16 checkpoint people dequantize it
  to): 4-bit symmetric groups of 32 on the routed experts only, everything else in ``ignore``.

Not faithful: the sizes (8 layers, hidden 64, 8 experts, 1024 token ids), the random weights, the
learnt vocabulary (256 byte tokens + 512 merges learnt from this repository's sample prompts, so
common English words are single tokens), no vision tower, and the INT4 variant's weights, which
stay bfloat16: a loader is expected to refuse the quantized checkpoint from its config before it
reads any weight. Special-token slots other than the ones named here are
``<|reserved_token_ID|>`` placeholders.

Loading: ``trust_remote_code=True`` gives the checkpoint's classes (``KimiK25Config``,
``KimiK25ForConditionalGeneration`` for ``AutoModel``/``AutoModelForCausalLM``,
``TikTokenTokenizer``). Without it ``AutoModelForCausalLM`` raises ``ValueError`` ("… contains
custom code which must be executed … Please pass the argument `trust_remote_code=True` …"), but
transformers 5.25 ships a native ``kimi_k25``: ``AutoConfig`` then returns its ``Kimi_K25Config``
(with a default vision config) and ``AutoTokenizer`` a fast ``TokenizersBackend`` converted from
``tiktoken.model`` with a generic pre-tokenizer regex, not Kimi's — as it would for the real
checkpoint.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

BYTE_TOKENS = 256
MERGES = 512
BASE_VOCAB = BYTE_TOKENS + MERGES  # mergeable ranks in tiktoken.model
RESERVED_SPECIAL = 256  # Kimi reserves 256 special-token slots after the ranks
VOCAB_SIZE = BASE_VOCAB + RESERVED_SPECIAL  # == len(tokenizer); the model's vocab_size, not rounded

# Kimi's special tokens by slot (offset from the first special id); the real ids are 163584 + slot.
SPECIAL_TOKEN_SLOTS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<think>": 22,
    "</think>": 23,
    "[UNK]": 254,
    "[PAD]": 255,
}
SPECIAL_TOKEN_IDS: dict[str, int] = {name: BASE_VOCAB + slot for name, slot in SPECIAL_TOKEN_SLOTS.items()}
THINK_TOKENS = ("<think>", "</think>")

TEXT_DIMS: dict[str, Any] = {
    "num_hidden_layers": 8,
    "first_k_dense_replace": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
}
ROPE_SCALING: dict[str, Any] = {
    "type": "yarn",
    "rope_type": "yarn",
    "factor": 64.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}
INIT_STD = 0.02
LAYERS_PER_SHARD = 2

_HERE = Path(__file__).resolve().parent
_SAMPLES = _HERE.parent.parent / "samples"
REMOTE_CODE = ("configuration_kimi_k25.py", "modeling_kimi_k25.py", "tokenization_kimi.py", "tool_declaration_ts.py")
CHAT_TEMPLATE = _HERE / "chat_template.jinja"

# The INT4 release's quantization_config: compressed-tensors, 4-bit symmetric int weights in groups
# of 32, on every Linear except those matched by ``ignore`` — so only the routed experts.
INT4_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "block_structure": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
        }
    },
    "ignore": [
        "lm_head",
        "re:.*lm_head.*",
        "re:.*embed_tokens.*",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
}


# -- the vocabulary ---------------------------------------------------------------------------------


def _sample_text(limit: int = 16_000) -> str:
    """The first ``limit`` characters of the repository's sample prompts (message texts, in file order)."""
    parts: list[str] = []
    for path in sorted(_SAMPLES.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line) if line.strip() else {}
            for turn in record.get("conversations", []) + record.get("messages", []):
                text = turn.get("value", turn.get("content"))
                if isinstance(text, str):
                    parts.append(text)
    text = "\n".join(parts)
    if len(text) < limit // 2:
        raise RuntimeError(f"too little sample text under {_SAMPLES} to learn a vocabulary")
    return text[:limit]


@lru_cache(maxsize=1)
def learn_ranks() -> tuple[bytes, ...]:
    """The mergeable tokens in rank order: the 256 bytes, then ``MERGES`` byte-pair merges.

    Plain byte-level BPE over the sample text split by Kimi's pre-tokenizer regex; each step merges
    the most frequent adjacent pair (ties: the smallest pair of byte strings), so the result is
    deterministic for a given text. Takes about a second.
    """
    import regex

    from eagle3_pipeline.testing.kimi.tokenization_kimi import PAT_STR

    words = Counter(regex.findall("(?V1)" + PAT_STR, _sample_text()))
    pieces: list[tuple[list[bytes], int]] = [([bytes([b]) for b in w.encode("utf-8")], n) for w, n in words.items()]
    tokens = [bytes([b]) for b in range(BYTE_TOKENS)]
    known = set(tokens)
    while len(tokens) < BASE_VOCAB:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for symbols, count in pieces:
            for pair in itertools.pairwise(symbols):
                pairs[pair] += count
        if not pairs:
            raise RuntimeError(f"the sample text yields only {len(tokens) - BYTE_TOKENS} merges")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        for symbols, _ in pieces:
            i = 0
            while i < len(symbols) - 1:
                if symbols[i] == best[0] and symbols[i + 1] == best[1]:
                    symbols[i : i + 2] = [merged]
                i += 1
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
    return tuple(tokens)


def _tokenizer_config(split_think: bool) -> dict[str, Any]:
    names = {BASE_VOCAB + slot: name for name, slot in SPECIAL_TOKEN_SLOTS.items()}
    if split_think:
        names = {i: n for i, n in names.items() if n not in THINK_TOKENS}
    decoder = {
        str(i): {
            "content": names.get(i, f"<|reserved_token_{i}|>"),
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i in range(BASE_VOCAB, VOCAB_SIZE)
    }
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "[EOT]",
            "<|im_system|>",
            "<|im_middle|>",
        ],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE.read_text(encoding="utf-8"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }


# -- the config ---------------------------------------------------------------------------------------


def text_config() -> dict[str, Any]:
    """The nested DeepSeek-V3 ``text_config`` of the stand-in."""
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": VOCAB_SIZE,
        **TEXT_DIMS,
        "num_nextn_predict_layers": 0,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 2.827,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rope_theta": 50000.0,
        "rope_scaling": dict(ROPE_SCALING),
        "rms_norm_eps": 1e-6,
        "initializer_range": INIT_STD,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": SPECIAL_TOKEN_IDS["[BOS]"],
        "eos_token_id": SPECIAL_TOKEN_IDS["[EOS]"],
        "pad_token_id": SPECIAL_TOKEN_IDS["[PAD]"],
        "torch_dtype": "bfloat16",
    }


def _config(int4: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "model_type": "kimi_k25",
        "ignore_index": -100,
        "media_placeholder_token_id": SPECIAL_TOKEN_IDS["<|media_pad|>"],
        "pad_token_id": SPECIAL_TOKEN_IDS["[PAD]"],
        "text_config": text_config(),
        "torch_dtype": "bfloat16",
    }
    if int4:
        config["quantization_config"] = json.loads(json.dumps(INT4_QUANTIZATION_CONFIG))
    return config


# -- the weights ------------------------------------------------------------------------------------


def weight_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint (names as in the files) and its shape."""
    d = TEXT_DIMS
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    qk_head = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    expert, shared = d["moe_intermediate_size"], d["moe_intermediate_size"] * d["n_shared_experts"]
    shapes: dict[str, tuple[int, ...]] = {"language_model.model.embed_tokens.weight": (VOCAB_SIZE, hidden)}
    for layer in range(d["num_hidden_layers"]):
        p = f"language_model.model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_a_proj.weight": (d["q_lora_rank"], hidden),
            p + "self_attn.q_a_layernorm.weight": (d["q_lora_rank"],),
            p + "self_attn.q_b_proj.weight": (heads * qk_head, d["q_lora_rank"]),
            p + "self_attn.kv_a_proj_with_mqa.weight": (d["kv_lora_rank"] + d["qk_rope_head_dim"], hidden),
            p + "self_attn.kv_a_layernorm.weight": (d["kv_lora_rank"],),
            p + "self_attn.kv_b_proj.weight": (heads * (d["qk_nope_head_dim"] + d["v_head_dim"]), d["kv_lora_rank"]),
            p + "self_attn.o_proj.weight": (hidden, heads * d["v_head_dim"]),
        }
        if layer < d["first_k_dense_replace"]:
            shapes |= {
                p + "mlp.gate_proj.weight": (d["intermediate_size"], hidden),
                p + "mlp.up_proj.weight": (d["intermediate_size"], hidden),
                p + "mlp.down_proj.weight": (hidden, d["intermediate_size"]),
            }
            continue
        shapes |= {
            p + "mlp.gate.weight": (d["n_routed_experts"], hidden),
            p + "mlp.gate.e_score_correction_bias": (d["n_routed_experts"],),
        }
        for e in range(d["n_routed_experts"]):
            shapes |= {
                p + f"mlp.experts.{e}.gate_proj.weight": (expert, hidden),
                p + f"mlp.experts.{e}.up_proj.weight": (expert, hidden),
                p + f"mlp.experts.{e}.down_proj.weight": (hidden, expert),
            }
        shapes |= {
            p + "mlp.shared_experts.gate_proj.weight": (shared, hidden),
            p + "mlp.shared_experts.up_proj.weight": (shared, hidden),
            p + "mlp.shared_experts.down_proj.weight": (hidden, shared),
        }
    shapes["language_model.model.norm.weight"] = (hidden,)
    shapes["language_model.lm_head.weight"] = (VOCAB_SIZE, hidden)
    return shapes


def _shard_of(name: str) -> int:
    """0: embeddings; 1..4: two decoder layers each; 5: final norm and lm_head."""
    if ".layers." in name:
        return 1 + int(name.split(".layers.")[1].split(".")[0]) // LAYERS_PER_SHARD
    return 0 if "embed_tokens" in name else 1 + TEXT_DIMS["num_hidden_layers"] // LAYERS_PER_SHARD


def _random_weights(seed: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, Any] = {}
    for name, shape in weight_shapes().items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
        elif name.endswith("e_score_correction_bias"):
            weights[name] = torch.zeros(shape, dtype=torch.float32)
        else:
            weights[name] = (torch.randn(shape, generator=generator) * INIT_STD).to(torch.bfloat16)
    return weights


def _write_shards(folder: Path, weights: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    shards: dict[int, dict[str, Any]] = {}
    for name, tensor in weights.items():
        shards.setdefault(_shard_of(name), {})[name] = tensor
    count = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for number in sorted(shards):
        file = f"model-{number + 1:05d}-of-{count:05d}.safetensors"
        save_file(shards[number], str(folder / file), metadata={"format": "pt"})
        for name, tensor in shards[number].items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# -- the folder -------------------------------------------------------------------------------------


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_kimi_checkpoint(folder: Path, *, int4: bool = False, split_think: bool = False, seed: int = 0) -> Path:
    """Write the tiny Kimi-K2.5 stand-in into ``folder`` (created) and return ``folder``.

    ``int4``: add the INT4 release's compressed-tensors ``quantization_config`` (weights unchanged,
    still bfloat16: only a loader's refusal is meant to be exercised). ``split_think``: a tokenizer
    that does not know ``<think>``/``</think>`` as special tokens (their slots become reserved
    placeholders), so they encode as ordinary byte tokens — the broken tokenizer users report under
    transformers 5. ``seed``: the random weights. Everything else is identical across variants.
    Loading needs ``trust_remote_code=True``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", _config(int4))
    _write_json(folder / "generation_config.json", {"eos_token_id": SPECIAL_TOKEN_IDS["<|im_end|>"]})
    for name in REMOTE_CODE:
        shutil.copyfile(_HERE / name, folder / name)
    shutil.copyfile(CHAT_TEMPLATE, folder / "chat_template.jinja")
    ranks = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(learn_ranks()))
    (folder / "tiktoken.model").write_text(ranks, encoding="ascii")
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(split_think))
    _write_shards(folder, _random_weights(seed))
    return folder


def build_kimi_text_checkpoint(folder: Path, *, seed: int = 0) -> Path:
    """The stand-in's language model alone as a DeepSeek-V3 checkpoint (``text_config`` as config.json,
    ``architectures: [DeepseekV3ForCausalLM]``, the weights without ``language_model.``, the same
    tokenizer): what vLLM 0.32's CPU build can load, which cannot build ``KimiK25ForConditionalGeneration``
    from the stand-in (it asks for an image processor the stand-in has no ``preprocessor_config.json``
    for). The target of the MLA draft head's vLLM checks."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", text_config())
    _write_json(folder / "generation_config.json", {"eos_token_id": SPECIAL_TOKEN_IDS["<|im_end|>"]})
    for name in ("tokenization_kimi.py", "tool_declaration_ts.py"):
        shutil.copyfile(_HERE / name, folder / name)
    shutil.copyfile(CHAT_TEMPLATE, folder / "chat_template.jinja")
    ranks = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(learn_ranks()))
    (folder / "tiktoken.model").write_text(ranks, encoding="ascii")
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(False))
    weights = _random_weights(seed)
    _write_shards(folder, {name.removeprefix("language_model."): tensor for name, tensor in weights.items()})
    return folder
