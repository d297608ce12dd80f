"""Exact ``emit`` loss masks for the Kimi-K2.5 family: the stand-in checkpoint's slow remote-code
``TikTokenTokenizer`` and its real K2.5 chat template (reasoning of finished turns blanked, the
generation prompt ending in ``<think>``, or ``<think></think>`` with ``thinking=False``).

Every template × conversation case is checked without the code under test: the row must be the
generation prompt's render tokenized on its own (the history as the generation client sends it,
``records.wire_message``), then the target's output written out by hand here — reasoning,
``</think>``, content, the tool-call section, ``<|im_end|>`` when the turn finished — masked
token for token, then only the template text the test names; inside the prompt only the earlier
generated turns named by the case are masked. The cases run on the checkpoint's tokenizer (whose
``<think>``/``</think>`` are special tokens) and on the split-think variant (byte tokens; the
markup set explicitly), with thinking on and off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.records import wire_message
from eagle3_pipeline.target.folder import load_tokenizer
from eagle3_pipeline.testing.c1_records import generated, message, response_row
from eagle3_pipeline.training_data import ChatRenderer, TemplateMismatch, stored_conversation, tokenize_conversation

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PARIS = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
ROME = {
    "id": "functions.get_weather:1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
}
SECTION = (
    "<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)
TWO_CALLS = (
    "<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)
END = "<|im_end|>"


@dataclass(frozen=True)
class Case:
    """A conversation (its last message the response) and what the row must hold."""

    name: str
    messages: list[dict[str, Any]]
    output: str  # the response's masked text
    earlier: list[str] = field(default_factory=list)  # masked text of earlier generated turns, in order
    after: str = ""  # template text after the output, unmasked
    tools: list[dict[str, Any]] | None = None


def cases(thinking: bool) -> list[Case]:
    """The conversations; with thinking off the target returns no reasoning and emits none."""

    def think(reasoning: str) -> str:
        return f"{reasoning}</think>" if thinking else ""

    def answer(
        content: str | None, finish: str = "stop", reasoning: str | None = None, **fields: Any
    ) -> dict[str, Any]:
        return generated(content, finish, reasoning_content=reasoning if thinking else None, **fields)

    user = message("user", "Name a prime.")
    out = [
        Case(
            "system, user, answer",
            [message("system", "You are terse."), user, answer("Seven.", reasoning="Small primes: 2, 3, 5, 7.")],
            think("Small primes: 2, 3, 5, 7.") + "Seven." + END,
        ),
        Case(
            "earlier turn's reasoning blanked",
            [
                user,
                answer("Seven.", reasoning="Seven is prime."),
                message("user", "Another one?"),
                answer("Eleven is prime.", reasoning="11 has no divisor but 1 and 11."),
            ],
            think("11 has no divisor but 1 and 11.") + "Eleven is prime." + END,
            earlier=["Seven." + END],
        ),
        Case(
            "source assistant turn not trained on",
            [
                user,
                message("assistant", "Seven."),
                message("user", "And the next?"),
                answer("Eleven.", reasoning="After 7: 11."),
            ],
            think("After 7: 11.") + "Eleven." + END,
        ),
        Case(
            "multi-turn, three generated",
            [
                user,
                answer("Two.", reasoning="The smallest."),
                message("user", "Bigger?"),
                answer("Three.", reasoning="Next."),
                message("user", "Biggest below ten?"),
                answer("Seven.", reasoning="Below 10: 7."),
            ],
            think("Below 10: 7.") + "Seven." + END,
            earlier=["Two." + END, "Three." + END],
        ),
        Case(
            "han script",
            [message("user", "说一个质数。"), answer("七是质数。", reasoning="七只能被一和七整除。")],
            think("七只能被一和七整除。") + "七是质数。" + END,
        ),
        Case(
            "tool call",
            [
                message("user", "Weather in Paris?"),
                answer(None, "tool_calls", "The user wants the weather.", tool_calls=[PARIS]),
            ],
            think("The user wants the weather.") + SECTION + END,
            tools=[WEATHER_TOOL],
        ),
        Case(
            "two tool calls after content",
            [
                message("user", "Paris and Rome?"),
                answer("Checking both.", "tool_calls", "Two cities, two calls.", tool_calls=[PARIS, ROME]),
            ],
            think("Two cities, two calls.") + "Checking both." + TWO_CALLS + END,
            tools=[WEATHER_TOOL],
        ),
        Case(
            "tool result as <|im_system|>tool, then the answer",
            [
                message("user", "Weather in Paris?"),
                answer(None, "tool_calls", "Ask the tool.", tool_calls=[PARIS]),
                message("tool", "18 C, sunny", tool_call_id="functions.get_weather:0"),
                answer("It is 18 C and sunny in Paris.", reasoning="The tool says 18 C."),
            ],
            think("The tool says 18 C.") + "It is 18 C and sunny in Paris." + END,
            earlier=[SECTION + END],
            tools=[WEATHER_TOOL],
        ),
        Case(
            "length-truncated answer",
            [user, answer("Two, three, fi", "length", "List a few.")],
            think("List a few.") + "Two, three, fi",
            after=END,
        ),
    ]
    if thinking:
        out += [
            Case(
                "reasoning, empty content",
                [user, answer("", reasoning="Nothing more to add.")],
                "Nothing more to add.</think>" + END,
            ),
            Case(
                "cut inside the reasoning",
                [user, answer(None, "length", "Let me count: one, two")],
                "Let me count: one, two",
                after="</think>" + END,
            ),
            Case("thinking on, no reasoning returned", [user, generated("Seven.")], "</think>Seven." + END),
        ]
    return out


def runs(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            out.append((start, i))
            start = None
    return out


def problems(tokenizer: Any, case: Case, kwargs: dict[str, Any], markup: tuple[str, str] | None) -> list[str]:
    """What is wrong with the case's row (nothing: an empty list)."""

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    row = response_row("r", "K", case.messages, tools=case.tools)
    renderer = ChatRenderer(tokenizer, "emit", kwargs, markup)
    try:
        ids, mask = tokenize_conversation(renderer, stored_conversation(row, "emit"))
    except TemplateMismatch as exc:
        return [f"mismatch: {exc}"]
    history = [wire_message(m) for m in case.messages[:-1]]
    prompt = tokenizer.apply_chat_template(
        history, tools=case.tools, tokenize=False, add_generation_prompt=True, **kwargs
    )
    header = "<|im_assistant|>assistant<|im_middle|>" + (
        "<think></think>" if kwargs.get("thinking") is False else "<think>"
    )
    found = []
    if not prompt.endswith(header):
        found.append(f"the generation prompt does not end with {header!r}")
    prompt_ids, output_ids, after_ids = encode(prompt), encode(case.output), encode(case.after)
    if ids != prompt_ids + output_ids + after_ids:
        found.append(f"row is {tokenizer.decode(ids)!r}, expected {prompt + case.output + case.after!r}")
    expected_mask = [0] * len(prompt_ids) + [1] * len(output_ids) + [0] * len(after_ids)
    spans = runs(mask)
    in_prompt = [(s, e) for s, e in spans if e <= len(prompt_ids)]
    masked_earlier = [tokenizer.decode(ids[s:e]) for s, e in in_prompt]
    if masked_earlier != case.earlier:
        found.append(f"earlier turns masked as {masked_earlier!r}, expected {case.earlier!r}")
    for (s, e), text in zip(in_prompt, case.earlier, strict=False):
        expected_mask[s:e] = [1] * (e - s)
        if ids[s:e] != encode(text):
            found.append(f"earlier turn {text!r} is not its own tokens")
    if mask != expected_mask:
        found.append(f"mask covers {[tokenizer.decode(ids[s:e]) for s, e in spans]!r}")
    earlier_reasoning = [m["reasoning_content"] for m in case.messages[:-1] if m.get("reasoning_content")]
    leaked = [r for r in earlier_reasoning if r in tokenizer.decode(ids)]
    if leaked:
        found.append(f"earlier reasoning not blanked: {leaked!r}")
    return found


@pytest.fixture(scope="module")
def tokenizers(
    kimi_checkpoint: Path, kimi_checkpoint_split_think: Path
) -> dict[str, tuple[Any, tuple[str, str] | None]]:
    split = load_tokenizer(str(kimi_checkpoint_split_think), trust_remote_code=True)
    assert "<think>" not in split.get_added_vocab()
    return {
        "Kimi-K2.5": (load_tokenizer(str(kimi_checkpoint), trust_remote_code=True), None),
        "Kimi-K2.5, <think> in byte tokens": (split, ("<think>", "</think>")),
    }


def test_emit_masks_are_exact_for_every_kimi_template_and_conversation(
    tokenizers: dict[str, tuple[Any, tuple[str, str] | None]],
) -> None:
    checked, failures = 0, []
    for name, (tokenizer, markup) in tokenizers.items():
        assert not tokenizer.is_fast and not hasattr(tokenizer, "backend_tokenizer")
        for kwargs in ({}, {"thinking": False}):
            for case in cases(thinking=kwargs.get("thinking", True)):
                checked += 1
                failures += [
                    f"{name} {kwargs or 'thinking on'} / {case.name}: {p}"
                    for p in problems(tokenizer, case, kwargs, markup)
                ]
    print(f"\n{checked} template × conversation cases checked, {len(failures)} mismatches")
    assert checked == 2 * (12 + 9)
    assert not failures, f"{len(failures)} of {checked} cases wrong:\n" + "\n".join(failures)


def test_the_checker_sees_a_wrong_mask(tokenizers: dict[str, tuple[Any, tuple[str, str] | None]]) -> None:
    """The exactness check above fails when the row is not what the target emitted."""
    tokenizer, _ = tokenizers["Kimi-K2.5"]
    [case] = [c for c in cases(thinking=True) if c.name == "system, user, answer"]
    wrong = Case(case.name, case.messages, "Seven." + END, after="")
    assert problems(tokenizer, wrong, {}, None)
    blanked = Case(case.name, case.messages, case.output, earlier=["You are terse."])
    assert any("earlier turns masked" in p for p in problems(tokenizer, blanked, {}, None))


def test_reasoning_with_thinking_off_or_without_markup_is_a_mismatch(
    tokenizers: dict[str, tuple[Any, tuple[str, str] | None]],
) -> None:
    tokenizer, _ = tokenizers["Kimi-K2.5"]
    row = response_row(
        "r", "K", [message("user", "Name a prime."), generated("Seven.", reasoning_content="Seven is prime.")]
    )
    with pytest.raises(
        TemplateMismatch,
        match=r"message 1: the turn has reasoning, but the chat template renders neither it nor an "
        r"empty thinking block \(<think></think>\)",
    ):
        tokenize_conversation(ChatRenderer(tokenizer, "emit", {"thinking": False}), stored_conversation(row, "emit"))
    split, _ = tokenizers["Kimi-K2.5, <think> in byte tokens"]
    no_markup = r"message 1: .* the tokenizer has no <think>/</think> added tokens .*set the thinking markup"
    with pytest.raises(TemplateMismatch, match=no_markup):
        tokenize_conversation(ChatRenderer(split, "emit"), stored_conversation(row, "emit"))


def test_render_mode_trains_on_the_blanked_render_and_emit_on_the_reasoning(
    tokenizers: dict[str, tuple[Any, tuple[str, str] | None]],
) -> None:
    tokenizer, _ = tokenizers["Kimi-K2.5"]
    row = response_row(
        "r", "K", [message("user", "Name a prime."), generated("Seven.", reasoning_content="Seven is prime.")]
    )

    def masked(reasoning: str) -> str:
        ids, mask = tokenize_conversation(ChatRenderer(tokenizer, reasoning), stored_conversation(row, reasoning))  # type: ignore[arg-type]
        return str(tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]))

    assert masked("render") == "Seven." + END  # K2.5 blanks a finished conversation's reasoning
    assert masked("emit") == "Seven is prime.</think>Seven." + END


def test_tool_declarations_reach_the_prompt(tokenizers: dict[str, tuple[Any, tuple[str, str] | None]]) -> None:
    tokenizer, _ = tokenizers["Kimi-K2.5"]
    [case] = [c for c in cases(thinking=True) if c.name == "tool call"]
    row = response_row("r", "K", case.messages, tools=case.tools)
    ids, mask = tokenize_conversation(ChatRenderer(tokenizer, "emit"), stored_conversation(row, "emit"))
    text = tokenizer.decode(ids[: mask.index(1)])
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>") and "get_weather" in text
    assert json.dumps(WEATHER_TOOL) not in text  # the TypeScript declaration, not the JSON schema
