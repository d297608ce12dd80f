"""The tiny Kimi-K2.5 stand-in: what loads it, what it holds, how its tokenizer and template behave."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tiktoken")

from eagle3_pipeline.testing.kimi.fixture import (
    BASE_VOCAB,
    INT4_QUANTIZATION_CONFIG,
    SPECIAL_TOKEN_IDS,
    TEXT_DIMS,
    VOCAB_SIZE,
    build_kimi_checkpoint,
    weight_shapes,
)
from eagle3_pipeline.testing.kimi.tool_declaration_ts import (
    encode_tools_to_typescript_style,
)

AutoConfig = transformers.AutoConfig
AutoModel = transformers.AutoModel
AutoModelForCausalLM = transformers.AutoModelForCausalLM
AutoTokenizer = transformers.AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(kimi_checkpoint: Path) -> Any:
    return AutoTokenizer.from_pretrained(kimi_checkpoint, trust_remote_code=True)


@pytest.fixture(scope="module")
def model(kimi_checkpoint: Path) -> Any:
    loaded, info = AutoModelForCausalLM.from_pretrained(
        kimi_checkpoint, trust_remote_code=True, dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing/unexpected/mismatched keys, no errors
    return loaded.eval()


def _index(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "model.safetensors.index.json").read_text())


# -- config ---------------------------------------------------------------------------------------


def test_config_is_remote_kimi_k25_over_a_deepseek_v3_text_config(kimi_checkpoint: Path, tokenizer: Any) -> None:
    raw = json.loads((kimi_checkpoint / "config.json").read_text())
    assert raw["model_type"] == "kimi_k25"
    assert raw["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert raw["auto_map"] == {
        "AutoConfig": "configuration_kimi_k25.KimiK25Config",
        "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    }
    assert not {"hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"} & set(raw)
    assert raw["torch_dtype"] == raw["text_config"]["torch_dtype"] == "bfloat16"
    assert raw["text_config"]["model_type"] == "deepseek_v3"
    assert raw["text_config"]["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "quantization_config" not in raw

    config = AutoConfig.from_pretrained(kimi_checkpoint, trust_remote_code=True)
    assert type(config).__name__ == "KimiK25Config"
    assert type(config).__module__.startswith("transformers_modules.")
    text = config.get_text_config()
    assert text is config.text_config
    assert isinstance(text, transformers.DeepseekV3Config)
    for key, value in TEXT_DIMS.items():
        assert getattr(text, key) == value, key
    assert text.num_hidden_layers > max(1, 3, 4)  # the EAGLE-3 default aux layers exist
    assert text.first_k_dense_replace < text.num_hidden_layers  # some layers are MoE
    assert text.qk_head_dim == 24 and text.kv_lora_rank == 16 and text.q_lora_rank == 32  # MLA
    assert text.max_position_embeddings == 262144 and text.rms_norm_eps == 1e-6
    assert text.tie_word_embeddings is False
    rope = text.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 64.0 and rope["rope_theta"] == 50000.0
    assert (rope["beta_fast"], rope["beta_slow"], rope["mscale"], rope["mscale_all_dim"]) == (32.0, 1.0, 1.0, 1.0)
    assert rope["original_max_position_embeddings"] == 4096
    assert text.vocab_size == len(tokenizer) == VOCAB_SIZE == 1024
    assert (text.bos_token_id, text.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)


def test_nothing_runs_the_remote_code_without_trust_remote_code(kimi_checkpoint: Path) -> None:
    # (An explicit False: left unset, transformers asks on an interactive terminal and waits.)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModelForCausalLM.from_pretrained(kimi_checkpoint, trust_remote_code=False)
    # transformers 5.25 knows `kimi_k25` natively: config and tokenizer then load, but as its own
    # classes (Kimi_K25Config; a fast TokenizersBackend converted from tiktoken.model), never the
    # checkpoint's code. Older releases refuse them as well.
    for auto in (AutoConfig, AutoTokenizer):
        try:
            loaded = auto.from_pretrained(kimi_checkpoint, trust_remote_code=False)
        except ValueError as exc:
            assert "trust_remote_code" in str(exc)
        else:
            assert not type(loaded).__module__.startswith("transformers_modules.")
            assert type(loaded).__name__ not in ("KimiK25Config", "TikTokenTokenizer")


# -- weights --------------------------------------------------------------------------------------


def test_weights_are_sharded_bf16_with_the_real_prefixes(kimi_checkpoint: Path) -> None:
    from safetensors import safe_open

    index = _index(kimi_checkpoint)
    weight_map: dict[str, str] = index["weight_map"]
    assert set(weight_map) == set(weight_shapes())
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 3
    assert all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", s) for s in shards)
    embed, head = weight_map["language_model.model.embed_tokens.weight"], weight_map["language_model.lm_head.weight"]
    assert embed != head
    for shard in (embed, head):
        assert not any(".layers." in n for n, s in weight_map.items() if s == shard)
    assert {n.split(".")[0] for n in weight_map} == {"language_model"}
    assert "language_model.model.norm.weight" in weight_map
    assert "language_model.model.layers.3.mlp.experts.7.down_proj.weight" in weight_map
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in weight_map  # the dense first layer

    total = 0
    for shard in shards:
        with safe_open(str(kimi_checkpoint / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                tensor = f.get_tensor(name)
                assert weight_map[name] == shard
                assert tuple(tensor.shape) == weight_shapes()[name]
                bias = name.endswith("e_score_correction_bias")
                assert tensor.dtype == (torch.float32 if bias else torch.bfloat16), name
                total += tensor.numel() * tensor.element_size()
    assert index["metadata"]["total_size"] == total


def test_model_loads_without_missing_keys_and_gives_finite_logits(
    model: Any, kimi_checkpoint: Path, tokenizer: Any
) -> None:
    from safetensors import safe_open

    assert type(model).__name__ == "KimiK25ForConditionalGeneration"
    assert model.base_model_prefix == "language_model"
    assert type(model.language_model) is transformers.DeepseekV3ForCausalLM
    assert model.get_input_embeddings() is model.language_model.model.embed_tokens
    assert model.get_output_embeddings() is model.language_model.lm_head
    assert model.get_decoder() is model.language_model.model

    ids = tokenizer.encode("<|im_user|>user<|im_middle|>What is the weather like today?<|im_end|>")
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            output_hidden_states=True,
            use_cache=False,
        )
        last = model(input_ids=torch.tensor([ids]), logits_to_keep=1, use_cache=False)
    assert out.logits.shape == (1, len(ids), VOCAB_SIZE)
    assert torch.isfinite(out.logits).all()
    assert out.logits.std() > 1e-2 and len(set(out.logits[0].argmax(-1).tolist())) > 1
    assert len(out.hidden_states) == TEXT_DIMS["num_hidden_layers"] + 1
    assert torch.allclose(last.logits[0, -1], out.logits[0, -1], atol=1e-5)

    # transformers fuses the per-expert tensors of the files into [E, 2I, H] / [E, H, I] on load.
    experts = model.language_model.model.layers[3].mlp.experts
    inter = TEXT_DIMS["moe_intermediate_size"]
    file = (
        kimi_checkpoint
        / _index(kimi_checkpoint)["weight_map"]["language_model.model.layers.3.mlp.experts.5.up_proj.weight"]
    )
    with safe_open(str(file), framework="pt") as f:
        prefix = "language_model.model.layers.3.mlp.experts.5."
        assert torch.equal(experts.gate_up_proj[5, :inter], f.get_tensor(prefix + "gate_proj.weight").float())
        assert torch.equal(experts.gate_up_proj[5, inter:], f.get_tensor(prefix + "up_proj.weight").float())
        assert torch.equal(experts.down_proj[5], f.get_tensor(prefix + "down_proj.weight").float())


def test_automodel_maps_to_the_same_class_and_settings_reach_the_language_model(kimi_checkpoint: Path) -> None:
    loaded = AutoModel.from_pretrained(kimi_checkpoint, trust_remote_code=True, attn_implementation="eager")
    assert type(loaded).__name__ == "KimiK25ForConditionalGeneration"
    assert loaded.language_model.config._attn_implementation == "eager"
    assert loaded.dtype == torch.bfloat16  # the checkpoint's dtype when none is asked for


def test_weights_follow_the_seed(tmp_path: Path, kimi_checkpoint: Path) -> None:
    def digests(folder: Path) -> list[str]:
        return [hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.safetensors"))]

    again = build_kimi_checkpoint(tmp_path / "same")
    other = build_kimi_checkpoint(tmp_path / "other", seed=1)
    assert digests(again) == digests(kimi_checkpoint)
    assert digests(other) != digests(kimi_checkpoint)
    assert (again / "tiktoken.model").read_bytes() == (kimi_checkpoint / "tiktoken.model").read_bytes()


def test_int4_variant_declares_compressed_tensors_on_routed_experts_only(
    kimi_checkpoint_int4: Path, kimi_checkpoint: Path
) -> None:
    raw = json.loads((kimi_checkpoint_int4 / "config.json").read_text())
    quant = raw.pop("quantization_config")
    assert raw == json.loads((kimi_checkpoint / "config.json").read_text())
    assert quant == INT4_QUANTIZATION_CONFIG
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "pack-quantized"
    weights = quant["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 32, True)
    assert quant["config_groups"]["group_0"]["targets"] == ["Linear"]

    def ignored(module: str) -> bool:
        return any(
            re.fullmatch(rule[3:], module) if rule.startswith("re:") else module == rule for rule in quant["ignore"]
        )

    linears = {
        n.removesuffix(".weight")
        for n, shape in weight_shapes().items()
        if len(shape) == 2 and not n.endswith(("embed_tokens.weight", "mlp.gate.weight"))
    }
    quantized = {m for m in linears if not ignored(m)}
    assert quantized and all(re.search(r"\.mlp\.experts\.\d+\.", m) for m in quantized)
    assert quantized == {m for m in linears if ".mlp.experts." in m}
    assert ignored("language_model.model.embed_tokens") and ignored("language_model.lm_head")
    assert _index(kimi_checkpoint_int4) == _index(kimi_checkpoint)  # same (bf16) weights

    if importlib.util.find_spec("compressed_tensors") is None:
        with pytest.raises(ImportError, match="compressed-tensors"):
            AutoModelForCausalLM.from_pretrained(kimi_checkpoint_int4, trust_remote_code=True)


# -- tokenizer ------------------------------------------------------------------------------------


def test_tokenizer_is_the_slow_remote_tiktoken_tokenizer(kimi_checkpoint: Path, tokenizer: Any) -> None:
    assert not (kimi_checkpoint / "tokenizer.json").exists()
    tok_config = json.loads((kimi_checkpoint / "tokenizer_config.json").read_text())
    assert tok_config["auto_map"] == {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    assert tok_config["chat_template"] == (kimi_checkpoint / "chat_template.jinja").read_text()
    assert type(tokenizer).__name__ == "TikTokenTokenizer"
    assert type(tokenizer).__module__.startswith("transformers_modules.")
    assert tokenizer.is_fast is False
    assert not hasattr(tokenizer, "backend_tokenizer")
    assert "offset_mapping" not in tokenizer("the weather", return_offsets_mapping=True)
    assert len(tokenizer) == tokenizer.vocab_size == VOCAB_SIZE
    lines = (kimi_checkpoint / "tiktoken.model").read_text().splitlines()
    assert len(lines) == BASE_VOCAB and lines[0].split() == ["AA==", "0"]


def test_every_special_token_is_one_id(tokenizer: Any) -> None:
    for name, token_id in SPECIAL_TOKEN_IDS.items():
        assert tokenizer.encode(name) == [token_id], name
        assert tokenizer(name, add_special_tokens=False)["input_ids"] == [token_id], name
        assert tokenizer.convert_tokens_to_ids(name) == token_id, name
        assert tokenizer.convert_ids_to_tokens(token_id) == name
        assert tokenizer.added_tokens_decoder[token_id].content == name
        assert tokenizer.added_tokens_decoder[token_id].special is True
    assert len(tokenizer.added_tokens_decoder) == VOCAB_SIZE - BASE_VOCAB
    assert tokenizer.added_tokens_decoder[BASE_VOCAB + 5].content == f"<|reserved_token_{BASE_VOCAB + 5}|>"
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token, tokenizer.pad_token) == (
        "[BOS]",
        "[EOS]",
        "[UNK]",
        "[PAD]",
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id, tokenizer.pad_token_id) == (
        768,
        769,
        1022,
        1023,
    )
    assert {"[BOS]", "[EOS]", "[UNK]", "[PAD]", "<|im_end|>", "<|im_middle|>"} <= set(tokenizer.all_special_tokens)
    assert (SPECIAL_TOKEN_IDS["<think>"], SPECIAL_TOKEN_IDS["</think>"]) == (790, 791)


def test_encode_decode_round_trip(tokenizer: Any) -> None:
    text = (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Café naïve 你好, "
        "what's 12345?\n\n  Tabs\tand spaces<|im_end|><|im_assistant|>assistant<|im_middle|>"
        "<think>Just add.</think>It is <|tool_calls_section_begin|>[EOS]"
    )
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert ids.count(SPECIAL_TOKEN_IDS["<think>"]) == ids.count(SPECIAL_TOKEN_IDS["</think>"]) == 1
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    batch = tokenizer([text, "the weather", "<think>"], add_special_tokens=False)["input_ids"]
    assert batch == [ids, tokenizer.encode("the weather"), [SPECIAL_TOKEN_IDS["<think>"]]]
    assert tokenizer.decode(tokenizer.encode("<|im_end|>x"), skip_special_tokens=True) == "x"
    assert len(tokenizer.encode(" the")) == 1 and len(tokenizer.encode(" and")) == 1  # learnt merges
    assert len(tokenizer.encode("What is the weather like today?")) < len("What is the weather like today?") / 2


def test_split_think_variant_spells_think_out_in_bytes(kimi_checkpoint_split_think: Path, tokenizer: Any) -> None:
    split = AutoTokenizer.from_pretrained(kimi_checkpoint_split_think, trust_remote_code=True)
    assert len(split) == len(tokenizer)
    for tag in ("<think>", "</think>"):
        ids = split.encode(tag)
        assert len(ids) > 1 and all(i < BASE_VOCAB for i in ids)
        assert split.decode(ids) == tag
        assert split(tag, add_special_tokens=False)["input_ids"] == ids
        assert split.convert_tokens_to_ids(tag) == split.unk_token_id
    text = "<|im_assistant|>assistant<|im_middle|><think>Check.</think>Done.<|im_end|>"
    ids = split.encode(text)
    assert split.decode(ids) == text
    assert SPECIAL_TOKEN_IDS["<think>"] not in ids and SPECIAL_TOKEN_IDS["<|im_middle|>"] in ids
    for name, token_id in SPECIAL_TOKEN_IDS.items():
        if name not in ("<think>", "</think>"):
            assert split.encode(name) == [token_id]
    assert split.encode("plain words only") == tokenizer.encode("plain words only")
    assert split.chat_template == tokenizer.chat_template


# -- chat template --------------------------------------------------------------------------------

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {
                    "type": "string",
                    "enum": ["celsius", "fahrenheit"],
                    "description": "Temperature unit",
                    "default": "celsius",
                },
                "city": {"type": "string", "description": "City name"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
WEATHER_TS = (
    "# Tools\n\n## functions\nnamespace functions {\n"
    "// Get the current weather for a city.\n"
    "type get_weather = (_: {\n"
    "  // City name\n"
    "  city: string,\n"
    "  // maximum: 7, minimum: 1\n"
    "  days?: number,\n"
    "  // Temperature unit\n"
    '  // Default: "celsius"\n'
    '  unit?: "celsius" | "fahrenheit"\n'
    "}) => any;\n"
    "}\n"
)
CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOL_LOOP: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "reasoning_content": "Simple sum.", "content": "4"},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "reasoning_content": "I should call the weather tool.",
        "content": None,
        "tool_calls": [CALL],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny, 21 C"},
]
TOOL_LOOP_TEXT = (
    "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think>4<|im_end|>"
    "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>I should call the weather tool.</think>"
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nSunny, 21 C<|im_end|>"
)


def test_final_answer_renders_with_its_reasoning_blanked(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "The user greets me.", "content": "Hello!"},
    ]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
    )


def test_generation_prompt_thinking_on_by_default_and_off(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    user = "<|im_user|>user<|im_middle|>Hi<|im_end|>"
    # Kimi's apply_chat_template defaults: tokenize=False, add_generation_prompt=True.
    assert tokenizer.apply_chat_template(messages) == user + "<|im_assistant|>assistant<|im_middle|><think>"
    assert tokenizer.apply_chat_template(messages, thinking=True) == (
        user + "<|im_assistant|>assistant<|im_middle|><think>"
    )
    assert tokenizer.apply_chat_template(messages, thinking=False) == (
        user + "<|im_assistant|>assistant<|im_middle|><think></think>"
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == user

    encoded = tokenizer.apply_chat_template(messages, tokenize=True)
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded  # transformers 5: a BatchEncoding
    assert ids == tokenizer.encode(user + "<|im_assistant|>assistant<|im_middle|><think>")
    assert ids[-1] == SPECIAL_TOKEN_IDS["<think>"]


def test_tool_loop_in_progress_keeps_its_reasoning(tokenizer: Any) -> None:
    generation = "<|im_assistant|>assistant<|im_middle|><think>"
    assert tokenizer.apply_chat_template(TOOL_LOOP) == TOOL_LOOP_TEXT + generation
    parsed = copy.deepcopy(TOOL_LOOP)
    parsed[3]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    assert tokenizer.apply_chat_template(parsed) == TOOL_LOOP_TEXT + generation

    off = tokenizer.apply_chat_template(TOOL_LOOP, thinking=False)
    assert off == TOOL_LOOP_TEXT.replace("<think>I should call the weather tool.</think>", "<think></think>") + (
        "<|im_assistant|>assistant<|im_middle|><think></think>"
    )

    finished = [*TOOL_LOOP, {"role": "assistant", "reasoning_content": "Report it.", "content": "It is sunny."}]
    text = tokenizer.apply_chat_template(finished, add_generation_prompt=False)
    assert text == TOOL_LOOP_TEXT.replace("<think>I should call the weather tool.</think>", "<think></think>") + (
        "<|im_assistant|>assistant<|im_middle|><think></think>It is sunny.<|im_end|>"
    )
    assert text.count("<think></think>") == 3 and "Report it." not in text

    ids = tokenizer.encode(TOOL_LOOP_TEXT)
    for name in (
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "<think>",
        "</think>",
    ):
        assert ids.count(SPECIAL_TOKEN_IDS[name]) == (2 if "think" in name else 1), name


def test_tools_are_declared_in_a_tool_declare_turn(tokenizer: Any) -> None:
    assert encode_tools_to_typescript_style([WEATHER_TOOL]) == WEATHER_TS
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    assert tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL]) == (
        "<|im_system|>tool_declare<|im_middle|>" + WEATHER_TS + "<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    )
    # A schema the TypeScript encoder does not render ($ref) falls back to compact, key-sorted JSON.
    ref_tool = copy.deepcopy(WEATHER_TOOL)
    ref_tool["function"]["parameters"]["properties"]["city"] = {"$ref": "#/$defs/City"}
    ref_tool["function"]["parameters"]["$defs"] = {"City": {"type": "string"}}
    text = tokenizer.apply_chat_template(messages, tools=[ref_tool], add_generation_prompt=False)

    def sort(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: sort(v) for k, v in sorted(value.items())}
        return [sort(v) for v in value] if isinstance(value, list) else value

    declared = json.dumps(sort([ref_tool]), separators=(",", ":"), ensure_ascii=False)
    assert text == (
        "<|im_system|>tool_declare<|im_middle|>" + declared + "<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
    )
