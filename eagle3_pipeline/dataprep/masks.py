"""Loss masks that cover exactly what the target generated.

A conversation is rendered once, whole, by the tokenizer's chat template (no prefix rendering, so
templates that rewrite earlier turns — Qwen3 drops the reasoning of turns before the last user
message — work). Each generated assistant turn is then located inside that full render:

- a template with ``{% generation %}`` blocks says itself which tokens are the assistant's
  (``return_assistant_tokens_mask``); the k-th block is the k-th assistant message;
- otherwise the turn is rendered once more with its content replaced by a marker character and
  its reasoning and tool calls left out. Both renders agree up to where the turn's generated text
  starts and from where it ends (the suffix never reaching back over the marker), so the
  difference is exactly what the turn's content, reasoning and native tool calls rendered to. Where the template renders the turn's reasoning, the span
  starts right after the generation prompt (``<think>`` and all, as the target emitted it).

The end-of-turn token is added only when the turn finished (``stop`` or ``tool_calls``): never
after a ``length`` stop, and never the whitespace a template writes after it. A conversation the
template cannot render faithfully raises :class:`TemplateMismatch`; the caller counts it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

ReasoningMode = Literal["render", "drop"]

FINISHED = frozenset({"stop", "tool_calls"})
# A character no answer contains, standing in for a turn's content in the comparison render.
MARKER = "\ue000"
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateMismatch(ValueError):
    """The chat template cannot render a generated turn so that its tokens can be located."""


@dataclass(frozen=True)
class Conversation:
    """A conversation in the form chat templates take, and which of its turns the target generated."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    generated: dict[int, bool]  # message index -> finished with an end-of-turn (stop / tool_calls)


def parse_tool_calls(text: str, index: int) -> list[dict[str, Any]]:
    """The OpenAI ``tool_calls`` JSON text as the list of dicts chat templates iterate over, each
    call's ``function.arguments`` parsed from its JSON string into the object templates ``tojson``."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TemplateMismatch(f"message {index}: tool_calls is not JSON ({exc.msg})") from None
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise TemplateMismatch(f"message {index}: tool_calls must be a JSON list of objects")
    parsed = []
    for call in calls:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except json.JSONDecodeError:
                arguments = function["arguments"]
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return parsed


def template_message(message: Mapping[str, Any], index: int, reasoning: ReasoningMode) -> dict[str, Any]:
    """A stored (contract C1) message in the form chat templates read."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message["role"] == "assistant":
        if reasoning == "render" and message.get("reasoning_content"):
            out["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            out["tool_calls"] = parse_tool_calls(message["tool_calls"], index)
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _common_prefix(x: str, y: str) -> int:
    lo, hi = 0, min(len(x), len(y))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if x[:mid] == y[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(x: str, y: str, limit: int) -> int:
    lo, hi = 0, min(len(x), len(y), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if x[len(x) - mid :] == y[len(y) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template and finds their generated spans."""

    def __init__(self, tokenizer: Any, reasoning: ReasoningMode) -> None:
        self.tokenizer = tokenizer
        self.reasoning: ReasoningMode = reasoning
        self.generation_blocks = bool(_GENERATION_BLOCK.search(tokenizer.chat_template or ""))
        special = set(tokenizer.all_special_tokens)
        special |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        self.special_tokens = sorted(special, key=len, reverse=True)
        self.special_ids = frozenset(tokenizer.convert_tokens_to_ids(sorted(special)))

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, generation_prompt: bool = False) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # a template's own raise_exception, or a jinja error on these messages
            raise TemplateMismatch(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        return str(text)

    def spans(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The full render and the character span of each generated turn in it, in order."""
        messages = conversation.messages
        full = self.render(messages, conversation.tools)
        spans = []
        for index, finished in sorted(conversation.generated.items()):
            blank = list(messages)
            blank[index] = {"role": "assistant", "content": MARKER}
            other = self.render(blank, conversation.tools)
            start = _common_prefix(full, other)
            marker = other.find(MARKER, start)
            if marker < 0:
                raise TemplateMismatch(f"message {index}: the template does not render the turn's content")
            end = len(full) - _common_suffix(full, other, len(other) - marker - len(MARKER))
            if end <= start:
                raise TemplateMismatch(f"message {index}: the template renders nothing of the generated turn")
            rendered = full[start:end]
            message = messages[index]
            for call in message.get("tool_calls") or []:
                name = (call.get("function") or call).get("name")
                if name and name not in rendered:
                    raise TemplateMismatch(f"message {index}: the chat template does not render tool call {name!r}")
            reasoning = (message.get("reasoning_content") or "").strip()
            if reasoning and reasoning in rendered:
                start = self._after_generation_prompt(full, messages[:index], conversation.tools, start, index)
            if finished:
                end = self._after_end_of_turn(full, end, index)
            spans.append((start, end))
        return full, spans

    def _after_generation_prompt(
        self, full: str, history: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, start: int, index: int
    ) -> int:
        """Where the target's own output of turn ``index`` starts: right after the generation prompt."""
        plain = self.render(history, tools)
        prompted = self.render(history, tools, generation_prompt=True)
        header = prompted[len(plain) :] if prompted.startswith(plain) else ""
        at = full.rfind(header, 0, start) if header else -1
        if at < 0:
            raise TemplateMismatch(f"message {index}: the generation prompt does not precede the turn's reasoning")
        return at + len(header)

    def _after_end_of_turn(self, full: str, end: int, index: int) -> int:
        """The end of the end-of-turn token that closes the turn at ``end`` (whitespace between kept)."""
        at = end
        while at < len(full) and full[at].isspace():
            at += 1
        for token in self.special_tokens:
            if full.startswith(token, at):
                return at + len(token)
        raise TemplateMismatch(f"message {index}: no end-of-turn token follows the finished turn")

    def block_mask(self, conversation: Conversation) -> tuple[list[int], list[int]]:
        """Token ids and mask from the template's own ``{% generation %}`` blocks, kept for the
        generated turns only, with the end-of-turn rules applied."""
        try:
            out = self.tokenizer.apply_chat_template(
                conversation.messages,
                tools=conversation.tools,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
        except Exception as exc:  # as in render()
            raise TemplateMismatch(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        ids = list(out["input_ids"])
        blocks = _runs(list(out["assistant_masks"]))
        assistants = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
        if len(blocks) != len(assistants):
            raise TemplateMismatch(
                f"{len(blocks)} generation blocks for {len(assistants)} assistant messages"
            )
        mask = [0] * len(ids)
        for (start, end), index in zip(blocks, assistants, strict=True):
            if index not in conversation.generated:
                continue
            end = self._trim_block(ids, start, end, conversation.generated[index])
            mask[start:end] = [1] * (end - start)
        return ids, mask

    def _trim_block(self, ids: list[int], start: int, end: int, finished: bool) -> int:
        stripped = end
        while stripped > start and not self.tokenizer.decode([ids[stripped - 1]]).strip():
            stripped -= 1
        if stripped > start and ids[stripped - 1] in self.special_ids:
            end = stripped
        if finished and ids[end - 1] not in self.special_ids and end < len(ids) and ids[end] in self.special_ids:
            return end + 1
        if not finished and ids[end - 1] in self.special_ids:
            return end - 1
        return end


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    start = None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append((start, i))
            start = None
    return runs


def token_mask(encoding: Any, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Token ranges of a fast-tokenizer ``Encoding`` whose tokens start inside the character spans."""
    ranges = []
    for start, end in spans:
        first = encoding.char_to_token(start)
        last = encoding.char_to_token(end - 1)
        if first is None or last is None:
            offsets = encoding.offsets
            inside = [t for t, (s, _) in enumerate(offsets) if start <= s < end]
            if inside:
                ranges.append((inside[0], inside[-1] + 1))
            continue
        if encoding.token_to_chars(first)[0] < start:
            first += 1
        if first <= last:
            ranges.append((first, last + 1))
    return ranges


def tokenize_conversation(renderer: ChatRenderer, conversation: Conversation) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and its 0/1 loss mask (one conversation, no batching)."""
    if renderer.generation_blocks:
        return renderer.block_mask(conversation)
    text, spans = renderer.spans(conversation)
    encoding = renderer.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    mask = [0] * len(encoding.ids)
    for start, end in token_mask(encoding, spans):
        mask[start:end] = [1] * (end - start)
    return list(encoding.ids), mask
