"""Exact loss masks for four template families, on the embedded model's real tokenizer.

The families: SmolLM2's own ChatML template, and three written for these tests on the same
tokenizer (their special tokens added to it) — Llama-3 style headers (plain, and with
``{% generation %}`` blocks), Qwen3 style (``<think>`` rendered only after the last user message),
and a tool-calling template with native ``<tool_call>`` tokens. For each, the masked tokens of a
fixture conversation, decoded run by run, must be exactly the generated text (+ the end-of-turn
token when the turn finished), token for token. SmolLM2's family also runs on a slow tokenizer
with the same vocabulary (transformers' Python backend: no offsets, no ``backend_tokenizer``);
``emit`` gives SmolLM2 the same rows as ``render``, and tokenizes the prompt on its own, as the
server did (where Llama-3's header ends in a blank line, that is one token alone and two before
the answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.target.folder import load_tokenizer
from eagle3_pipeline.testing.c1_records import generated, message, response_row
from eagle3_pipeline.training_data import ChatRenderer, TemplateMismatch, stored_conversation, tokenize_conversation
from eagle3_pipeline.training_data.masks import Piece, slow_piece_tokens

pytestmark = pytest.mark.local_model

LLAMA3 = (
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# The same family with the template's own assistant mask; the block ends with a newline after
# <|eot_id|> to check that template whitespace after the end-of-turn token is never trained on.
LLAMA3_GENERATION = (
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if m.role == 'assistant' %}{% generation %}{{- m.content | trim + '<|eot_id|>\\n' }}{% endgeneration %}"
    "{%- else %}{{- m.content | trim + '<|eot_id|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user and (loop.last or m.reasoning_content) %}"
    "{{- '<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for t in tools %}{{- t | tojson }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + m.content }}"
    "{%- for call in m.tool_calls or [] %}"
    "{{- '<tool_call>' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson"
    " + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def family(local_model: Path, template: str | None, special: list[str], added: Sequence[str] = ()) -> Any:
    tokenizer = load_tokenizer(str(local_model))
    tokenizer.add_tokens(special, special_tokens=True)
    tokenizer.add_tokens(list(added))
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def smollm(local_model: Path) -> Any:
    return family(local_model, None, [])


def slow_tokenizer(fast: Any) -> Any:
    """A slow tokenizer with ``fast``'s vocabulary, added tokens and template: transformers' Python
    backend (added tokens split by its trie, then ``_tokenize``), the BPE of each piece between
    added tokens done by the fast tokenizer's model. No offsets and no ``backend_tokenizer``, like
    Kimi's TikTokenTokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizer

    class SlowBPE(PreTrainedTokenizer):
        def __init__(self) -> None:
            self.bpe = Tokenizer.from_str(fast.backend_tokenizer.to_str())
            self.vocab = fast.get_vocab()
            self.tokens = {i: t for t, i in self.vocab.items()}
            super().__init__(
                added_tokens_decoder=dict(fast.added_tokens_decoder), eos_token=fast.eos_token, bos_token=fast.bos_token
            )
            self.chat_template = fast.chat_template

        @property
        def vocab_size(self) -> int:
            return len(self.vocab)

        def get_vocab(self) -> dict[str, int]:
            return dict(self.vocab)

        def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
            return list(self.bpe.encode(text, add_special_tokens=False).tokens)

        def _convert_token_to_id(self, token: str) -> int:
            return int(self.vocab[token])

        def _convert_id_to_token(self, index: int) -> str:
            return str(self.tokens[index])

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return str(self.bpe.decoder.decode(tokens))

    slow = SlowBPE()
    assert not slow.is_fast and not hasattr(slow, "backend_tokenizer")
    return slow


@pytest.fixture(scope="module")
def smollm_slow(smollm: Any) -> Any:
    return slow_tokenizer(smollm)


@pytest.fixture(scope="module")
def llama3(local_model: Path) -> Any:
    return family(local_model, LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])


@pytest.fixture(scope="module")
def llama3_generation(local_model: Path) -> Any:
    return family(local_model, LLAMA3_GENERATION, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])


@pytest.fixture(scope="module")
def qwen3(local_model: Path) -> Any:
    return family(local_model, QWEN3, [], added=["<think>", "</think>"])


@pytest.fixture(scope="module")
def tools(local_model: Path) -> Any:
    return family(
        local_model,
        TOOLS,
        ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"],
    )


def masked_runs(tokenizer: Any, row: dict[str, Any], reasoning: str = "render") -> tuple[list[list[int]], str]:
    """The masked token runs of a row, and the whole render with the masked text bracketed (for failures)."""
    renderer = ChatRenderer(tokenizer, reasoning)  # type: ignore[arg-type]
    ids, mask = tokenize_conversation(renderer, stored_conversation(row, reasoning))  # type: ignore[arg-type]
    assert len(ids) == len(mask)
    runs: list[list[int]] = []
    shown = []
    for i, (token, bit) in enumerate(zip(ids, mask, strict=True)):
        if bit and (i == 0 or not mask[i - 1]):
            runs.append([])
            shown.append("⟦")
        if bit:
            runs[-1].append(token)
        shown.append(tokenizer.decode([token]))
        if bit and (i + 1 == len(mask) or not mask[i + 1]):
            shown.append("⟧")
    return runs, "".join(shown)


def assert_masks(tokenizer: Any, row: dict[str, Any], expected: list[str], reasoning: str = "render") -> None:
    runs, shown = masked_runs(tokenizer, row, reasoning)
    decoded = [tokenizer.decode(run) for run in runs]
    detail = f"\nmasked text: {decoded!r}\nexpected:    {expected!r}\nrender with masked spans ⟦…⟧:\n{shown}"
    assert decoded == expected, detail
    for run, text in zip(runs, expected, strict=True):
        assert run == tokenizer(text, add_special_tokens=False)["input_ids"], f"token for token: {text!r}" + detail


def two_turns(final_finish: str = "stop", **final: Any) -> dict[str, Any]:
    return response_row(
        "r1",
        "D",
        [
            message("user", "Name a prime."),
            generated("Seven.", reasoning_content="Small primes: 2, 3, 5, 7."),
            message("user", "Another one?"),
            generated(final.pop("content", "Eleven is prime."), final_finish, **final),
        ],
    )


def test_smollm2_chatml_masks_generated_turns_and_their_end_of_turn(smollm: Any) -> None:
    assert_masks(smollm, two_turns(), ["Seven.<|im_end|>", "Eleven is prime.<|im_end|>"])


def test_smollm2_length_stop_trains_on_the_content_without_end_of_turn(smollm: Any) -> None:
    assert_masks(smollm, two_turns("length", content="Eleven is"), ["Seven.<|im_end|>", "Eleven is"])


def test_smollm2_only_generated_turns_are_masked(smollm: Any) -> None:
    row = two_turns()
    row["messages"][1] = message("assistant", "Seven.")  # from the source dataset, not generated here
    assert_masks(smollm, row, ["Eleven is prime.<|im_end|>"])


def test_smollm2_answer_equal_to_the_question_is_found_in_its_own_turn(smollm: Any) -> None:
    row = response_row("r2", "D", [message("user", "Yes."), generated("Yes.")])
    assert_masks(smollm, row, ["Yes.<|im_end|>"])


def smollm_rows() -> list[dict[str, Any]]:
    return [
        two_turns(),
        two_turns("length", content="Eleven is"),
        response_row("r2", "D", [message("user", "Yes."), generated("Yes.")]),
        response_row(
            "r3",
            "D",
            [
                message("system", "Be brief."),
                message("user", "Hi!"),
                message("assistant", "Hello."),
                message("user", "A word with  two spaces\n\n and lines?"),
                generated("Indented\n\nanswer  "),
            ],
        ),
    ]


@pytest.mark.parametrize("reasoning", ["emit", "render"])
def test_smollm2_on_a_slow_tokenizer_masks_exactly_what_the_fast_one_does(
    smollm: Any, smollm_slow: Any, reasoning: str
) -> None:
    assert_masks(smollm_slow, two_turns(), ["Seven.<|im_end|>", "Eleven is prime.<|im_end|>"], reasoning)
    assert_masks(smollm_slow, two_turns("length", content="Eleven is"), ["Seven.<|im_end|>", "Eleven is"], reasoning)
    for row in smollm_rows():
        conversation = stored_conversation(row, reasoning)  # type: ignore[arg-type]
        fast = tokenize_conversation(ChatRenderer(smollm, reasoning), conversation)  # type: ignore[arg-type]
        assert tokenize_conversation(ChatRenderer(smollm_slow, reasoning), conversation) == fast, row["id"]  # type: ignore[arg-type]


def test_emit_gives_the_rows_render_gives_on_smollm2(smollm: Any, smollm_slow: Any) -> None:
    for tokenizer in (smollm, smollm_slow):
        for row in smollm_rows():
            emitted = tokenize_conversation(ChatRenderer(tokenizer, "emit"), stored_conversation(row, "emit"))
            rendered = tokenize_conversation(ChatRenderer(tokenizer, "render"), stored_conversation(row, "render"))
            assert emitted == rendered and sum(emitted[1]) > 0, row["id"]


def test_an_answer_that_starts_with_spaces_is_the_prompt_s_tokens_then_the_answer_s(
    smollm: Any, smollm_slow: Any
) -> None:
    row = response_row("r4", "D", [message("user", "Hi"), generated("  Indented")])
    prompt = smollm.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    prompt_ids = smollm.encode(prompt, add_special_tokens=False)
    for tokenizer in (smollm, smollm_slow):
        ids, mask = tokenize_conversation(ChatRenderer(tokenizer, "emit"), stored_conversation(row, "emit"))
        assert ids[: len(prompt_ids)] == prompt_ids and not any(mask[: len(prompt_ids)])
        assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "  Indented<|im_end|>"
    # Rendered whole, the template's newline and the answer's first space become one token, which
    # no mask can split: the fast tokenizer's offsets leave it out, the slow tokenizer's check refuses it.
    ids, mask = tokenize_conversation(ChatRenderer(smollm, "render"), stored_conversation(row, "render"))
    assert smollm.decode([t for t, m in zip(ids, mask, strict=True) if m]) == " Indented<|im_end|>"
    with pytest.raises(TemplateMismatch, match="joins the text on both sides of character"):
        tokenize_conversation(ChatRenderer(smollm_slow, "render"), stored_conversation(row, "render"))


def test_a_slow_tokenizer_that_merges_across_a_span_edge_is_a_mismatch(smollm_slow: Any) -> None:
    word = "considerable"
    [token] = smollm_slow.encode(" " + word, add_special_tokens=False)  # one token: no edge inside it
    with pytest.raises(
        TemplateMismatch, match=r"joins the text on both sides of character 4 into one token \(' con' \| 'siderable"
    ):
        slow_piece_tokens(smollm_slow, Piece(" " + word, ((4, len(word) + 1),)))
    assert slow_piece_tokens(smollm_slow, Piece(f"Hi {word}", ((2, len(word) + 3),))) == (
        smollm_slow.encode(f"Hi {word}", add_special_tokens=False),
        [0, 1],
    )


def test_llama3_headers(llama3: Any) -> None:
    assert_masks(llama3, two_turns(), ["Seven.<|eot_id|>", "Eleven is prime.<|eot_id|>"])
    assert_masks(llama3, two_turns("length", content="Eleven is"), ["Seven.<|eot_id|>", "Eleven is"])


@pytest.mark.parametrize("reasoning", ["render", "emit"])
def test_llama3_generation_blocks_drop_trailing_whitespace_and_unfinished_end_of_turn(
    llama3_generation: Any, reasoning: str
) -> None:
    assert ChatRenderer(llama3_generation, "render").generation_blocks
    assert_masks(llama3_generation, two_turns(), ["Seven.<|eot_id|>", "Eleven is prime.<|eot_id|>"], reasoning)
    assert_masks(
        llama3_generation, two_turns("length", content="Eleven is"), ["Seven.<|eot_id|>", "Eleven is"], reasoning
    )


@pytest.mark.parametrize("fixture", ["llama3", "llama3_generation"])
def test_emit_tokenizes_the_prompt_alone_as_the_server_did(request: pytest.FixtureRequest, fixture: str) -> None:
    tokenizer = request.getfixturevalue(fixture)
    row = two_turns()
    history = [{"role": m["role"], "content": m["content"]} for m in row["messages"][:3]]
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids, mask = tokenize_conversation(ChatRenderer(tokenizer, "emit"), stored_conversation(row, "emit"))
    earlier = tokenizer.encode("Seven.<|eot_id|>", add_special_tokens=False)
    output = tokenizer.encode("Eleven is prime.<|eot_id|>", add_special_tokens=False)
    assert ids[: len(prompt_ids)] == prompt_ids and sum(mask[: len(prompt_ids)]) == len(earlier)
    n = len(prompt_ids) + len(output)
    assert ids[len(prompt_ids) : n] == output and mask[len(prompt_ids) :] == [1] * len(output) + [0] * (len(ids) - n)
    # Alone, the header's blank line is one token; followed by the answer in one text, it is two.
    assert tokenizer.convert_ids_to_tokens(prompt_ids[-1:]) == ["ĊĊ"]
    rendered, _ = tokenize_conversation(ChatRenderer(tokenizer, "render"), stored_conversation(row, "render"))
    assert tokenizer.convert_ids_to_tokens(rendered[len(prompt_ids) - 1 : len(prompt_ids) + 1]) == ["Ċ", "Ċ"]


def test_qwen3_reasoning_rendered_in_the_last_turn_only(qwen3: Any) -> None:
    row = two_turns(reasoning_content="11 has no divisor but 1 and 11.")
    # The earlier turn's reasoning is removed by the template (it precedes the last user message).
    think = "<think>\n11 has no divisor but 1 and 11.\n</think>\n\n"
    assert_masks(qwen3, row, ["Seven.<|im_end|>", f"{think}Eleven is prime.<|im_end|>"])
    assert_masks(qwen3, row, ["Seven.<|im_end|>", "Eleven is prime.<|im_end|>"], reasoning="drop")
    cut = two_turns("length", content="Eleven", reasoning_content="11 has no divisor but 1 and 11.")
    assert_masks(qwen3, cut, ["Seven.<|im_end|>", f"{think}Eleven"])


def test_qwen3_empty_think_block_of_the_template_is_not_trained_on(qwen3: Any) -> None:
    assert_masks(qwen3, two_turns(), ["Seven.<|im_end|>", "Eleven is prime.<|im_end|>"])


def test_qwen3_emit_trains_on_the_think_block_the_target_emitted_after_the_generation_prompt(qwen3: Any) -> None:
    row = two_turns(reasoning_content="11 has no divisor but 1 and 11.")
    think = "<think>\n11 has no divisor but 1 and 11.\n</think>\n\n"
    assert_masks(qwen3, row, ["Seven.<|im_end|>", f"{think}Eleven is prime.<|im_end|>"], reasoning="emit")
    # The template writes an empty block for a last turn without reasoning: the target emitted it.
    assert_masks(
        qwen3, two_turns(), ["Seven.<|im_end|>", "<think>\n\n</think>\n\nEleven is prime.<|im_end|>"], reasoning="emit"
    )


def tool_row() -> dict[str, Any]:
    call = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    return response_row(
        "t1",
        "T",
        [
            message("user", "Weather in Paris?"),
            generated(None, "tool_calls", tool_calls=call),
            message("tool", "18 C, sunny", tool_call_id="call_1", name="get_weather"),
            generated("It is 18 C and sunny in Paris."),
        ],
        tools=[WEATHER_TOOL],
    )


def test_tool_template_renders_native_tool_calls(tools: Any) -> None:
    assert_masks(
        tools,
        tool_row(),
        [
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>',
            "It is 18 C and sunny in Paris.<|im_end|>",
        ],
    )


def test_a_template_without_tool_calls_is_a_mismatch_not_a_wrong_mask(smollm: Any) -> None:
    row = tool_row()
    with pytest.raises(TemplateMismatch, match="message 1: the template renders nothing of the generated turn"):
        masked_runs(smollm, row)
    row["messages"][1]["content"] = "Let me look that up."
    with pytest.raises(TemplateMismatch, match="message 1: the chat template does not render tool call 'get_weather'"):
        masked_runs(smollm, row)
