"""Exact loss masks for four template families, on the embedded model's real tokenizer.

The families: SmolLM2's own ChatML template, and three written for these tests on the same
tokenizer (their special tokens added to it) — Llama-3 style headers (plain, and with
``{% generation %}`` blocks), Qwen3 style (``<think>`` rendered only after the last user message),
and a tool-calling template with native ``<tool_call>`` tokens. For each, the masked tokens of a
fixture conversation, decoded run by run, must be exactly the generated text (+ the end-of-turn
token when the turn finished), token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.dataprep import ChatRenderer, TemplateMismatch, stored_conversation, tokenize_conversation
from eagle3_pipeline_tests.c1_records import generated, message, response_row

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
    "{{- '<tool_call>' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>tool\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def family(local_model: Path, template: str | None, special: list[str], added: list[str] = ()) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(local_model))
    tokenizer.add_tokens(special, special_tokens=True)
    tokenizer.add_tokens(list(added))
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def smollm(local_model: Path) -> Any:
    return family(local_model, None, [])


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
    return family(local_model, TOOLS, ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"])


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


def test_llama3_headers(llama3: Any) -> None:
    assert_masks(llama3, two_turns(), ["Seven.<|eot_id|>", "Eleven is prime.<|eot_id|>"])
    assert_masks(llama3, two_turns("length", content="Eleven is"), ["Seven.<|eot_id|>", "Eleven is"])


def test_llama3_generation_blocks_drop_trailing_whitespace_and_unfinished_end_of_turn(llama3_generation: Any) -> None:
    assert ChatRenderer(llama3_generation, "render").generation_blocks
    assert_masks(llama3_generation, two_turns(), ["Seven.<|eot_id|>", "Eleven is prime.<|eot_id|>"])
    assert_masks(llama3_generation, two_turns("length", content="Eleven is"), ["Seven.<|eot_id|>", "Eleven is"])


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
