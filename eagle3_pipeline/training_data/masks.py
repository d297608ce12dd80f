"""Loss masks that cover exactly what the target generated, for fast and slow tokenizers.

A row is made as ``training_data.reasoning`` says: ``emit`` (the default: the prompt as the server
rendered it for generation, then the turn the target emitted, masked), ``render`` (the whole
conversation rendered once, each generated turn masked where it renders) or ``drop`` (``render``
without the reasoning). :class:`ChatRenderer` locates each generated turn in a render;
:func:`tokenize_row` tokenizes a row piece by piece and maps the masked spans to tokens. A conversation
the template cannot render faithfully raises :class:`TemplateMismatch`; the caller counts it. How and
why, in detail: training_data/DESIGN.md, "Loss masks".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

ReasoningMode = Literal["emit", "render", "drop"]

FINISHED = frozenset({"stop", "tool_calls"})
# A character no answer contains, standing in for a turn's content in the comparison render.
MARKER = "\ue000"
# The thinking markup looked for among the tokenizer's added tokens (open, close).
THINKING_TOKENS = ("<think>", "</think>")
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateMismatch(ValueError):
    """The chat template cannot render a generated turn so that its tokens can be located."""


@dataclass(frozen=True)
class Conversation:
    """A conversation in the form chat templates take, and which of its turns the target generated."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    generated: dict[int, bool]  # message index -> finished with an end-of-turn (stop / tool_calls)


@dataclass(frozen=True)
class Piece:
    """Text tokenized on its own, and the character spans of it that are trained on."""

    text: str
    spans: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Row:
    """A conversation ready to tokenize: the token ids and mask the template's own generation blocks
    gave (if any), then pieces of text; the row's tokens are their concatenation."""

    pieces: tuple[Piece, ...]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)


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
    """A stored (contract C1) message in the form chat templates read (reasoning kept unless ``drop``)."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message["role"] == "assistant":
        if reasoning != "drop" and message.get("reasoning_content"):
            out["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            out["tool_calls"] = parse_tool_calls(message["tool_calls"], index)
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A history message as the generation client sent it back to the server: no reasoning."""
    return {k: v for k, v in message.items() if k != "reasoning_content"}


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


def _check_tool_calls(message: Mapping[str, Any], rendered: str, index: int) -> None:
    """Each of the turn's tool calls is in its render (by function name, or by call id: Kimi's
    template writes the id, ``functions.NAME:N``)."""
    for call in message.get("tool_calls") or []:
        name = (call.get("function") or call).get("name")
        call_id = call.get("id")
        if name and name not in rendered and not (call_id and str(call_id) in rendered):
            raise TemplateMismatch(f"message {index}: the chat template does not render tool call {name!r}")


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template and finds their generated spans.

    ``chat_template_kwargs`` go to every render (e.g. ``{"thinking": False}`` for Kimi-K2.5: the
    server got the same). ``thinking_markup`` (open, close) is where ``emit`` puts reasoning the
    template leaves out; default: ``<think>``/``</think>`` when the tokenizer has both as added tokens.
    """

    def __init__(
        self,
        tokenizer: Any,
        reasoning: ReasoningMode,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        thinking_markup: tuple[str, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.reasoning: ReasoningMode = reasoning
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.fast = bool(getattr(tokenizer, "is_fast", False))
        # A template's own assistant mask maps characters to tokens by offsets: fast tokenizers only.
        self.generation_blocks = self.fast and bool(_GENERATION_BLOCK.search(tokenizer.chat_template or ""))
        special = set(tokenizer.all_special_tokens)
        special |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        self.special_tokens = sorted(special, key=len, reverse=True)
        self.special_ids = frozenset(tokenizer.convert_tokens_to_ids(sorted(special)))
        added = tokenizer.get_added_vocab()
        found = THINKING_TOKENS if all(t in added for t in THINKING_TOKENS) else None
        self.thinking_markup = thinking_markup or found

    def render(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, generation_prompt: bool = False
    ) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tools=tools,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **self.chat_template_kwargs,
            )
        except Exception as exc:  # a template's own raise_exception, or a jinja error on these messages
            raise TemplateMismatch(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        return str(text)

    def row(self, conversation: Conversation) -> Row:
        """The conversation as the pieces the row is tokenized from, in this renderer's mode."""
        if self.reasoning == "emit":
            return self._emitted_row(conversation)
        if self.generation_blocks:
            ids, mask = self.block_mask(conversation)
            return Row((), ids, mask)
        text, spans = self.spans(conversation)
        return Row((Piece(text, tuple(spans)),))

    def _emitted_row(self, conversation: Conversation) -> Row:
        index = max(conversation.generated)
        history = [_without_reasoning(m) for m in conversation.messages[:index]]
        if not history:
            raise TemplateMismatch(f"message {index}: a generated turn with no message before it has no prompt")
        earlier = {i: finished for i, finished in conversation.generated.items() if i < index}
        before = Conversation(history, conversation.tools, earlier)
        head: list[Piece] = []
        ids: list[int] = []
        mask: list[int] = []
        if self.generation_blocks:
            ids, mask = self.block_mask(before, generation_prompt=True)
            prompt = self.render(history, conversation.tools, generation_prompt=True)
        else:
            prompt, spans = self.spans(before, generation_prompt=True)
            head.append(Piece(prompt, tuple(spans)))
        message = conversation.messages[index]
        output, rest = self.emitted(history, message, conversation.tools, prompt, index, conversation.generated[index])
        pieces = [*head, Piece(output, ((0, len(output)),)), Piece(rest)]
        return Row(tuple(p for p in pieces if p.text), ids, mask)

    def emitted(
        self,
        history: Sequence[dict[str, Any]],
        message: dict[str, Any],
        tools: list[dict[str, Any]] | None,
        prompt: str,
        index: int,
        finished: bool,
    ) -> tuple[str, str]:
        """What the target emitted for turn ``index`` after ``prompt`` (the generation prompt's
        render of ``history``), and the template's own text after it."""
        turn = self.render([*history, message], tools)
        if not turn.startswith(prompt):
            raise TemplateMismatch(
                f"message {index}: the template's render of the turn does not start with the generation prompt's "
                "render (it renders the history differently once the turn is added)"
            )
        start = len(prompt)
        reasoning = message.get("reasoning_content") or ""
        if reasoning.strip() and reasoning.strip() not in turn[start:]:
            turn = self._with_reasoning(turn, start, reasoning, index)
        text = turn[start:]
        closed = text.rstrip()
        end_token = next((t for t in self.special_tokens if closed.endswith(t)), None)
        if end_token is None:
            raise TemplateMismatch(f"message {index}: no end-of-turn token closes the turn")
        body = len(closed) - len(end_token)
        if not text[:body].strip():
            raise TemplateMismatch(f"message {index}: the template renders nothing of the generated turn")
        _check_tool_calls(message, text[:body], index)
        end = len(closed) if finished else body
        close = self.thinking_markup[1] if self.thinking_markup else None
        cut_in_reasoning = not finished and reasoning and not (message.get("content") or message.get("tool_calls"))
        if cut_in_reasoning and close and text.endswith(close, 0, end):
            end -= len(close)  # the target never closed its reasoning
        return text[:end], text[end:]

    def _with_reasoning(self, turn: str, start: int, reasoning: str, index: int) -> str:
        """``turn`` with ``reasoning`` inside the empty thinking block where the target's output
        starts (at ``start``, or straddling it when the generation prompt ends with the open tag)."""
        if self.thinking_markup is None:
            raise TemplateMismatch(
                f"message {index}: the chat template leaves the turn's reasoning out, and the tokenizer has no "
                f"{THINKING_TOKENS[0]}/{THINKING_TOKENS[1]} added tokens to put it between (set the thinking markup)"
            )
        open_tag, close_tag = self.thinking_markup
        for at in (start - len(open_tag), start):
            if at >= 0 and turn.startswith(open_tag + close_tag, at):
                cut = at + len(open_tag)
                return turn[:cut] + reasoning + turn[cut:]
        raise TemplateMismatch(
            f"message {index}: the turn has reasoning, but the chat template renders neither it nor an empty thinking "
            f"block ({open_tag}{close_tag}) where the target's output starts"
        )

    def spans(self, conversation: Conversation, generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The full render (with the generation prompt if asked) and the character span of each
        generated turn in it, in order."""
        messages = conversation.messages
        full = self.render(messages, conversation.tools, generation_prompt)
        spans = []
        for index, finished in sorted(conversation.generated.items()):
            blank = list(messages)
            blank[index] = {"role": "assistant", "content": MARKER}
            other = self.render(blank, conversation.tools, generation_prompt)
            start = _common_prefix(full, other)
            marker = other.find(MARKER, start)
            if marker < 0:
                raise TemplateMismatch(f"message {index}: the template does not render the turn's content")
            end = len(full) - _common_suffix(full, other, len(other) - marker - len(MARKER))
            if end <= start:
                raise TemplateMismatch(f"message {index}: the template renders nothing of the generated turn")
            message = messages[index]
            _check_tool_calls(message, full[start:end], index)
            reasoning = (message.get("reasoning_content") or "").strip()
            if reasoning and reasoning in full[start:end]:
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

    def block_mask(self, conversation: Conversation, generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """Token ids and mask from the template's own ``{% generation %}`` blocks, kept for the
        generated turns only, with the end-of-turn rules applied."""
        try:
            out = self.tokenizer.apply_chat_template(
                conversation.messages,
                tools=conversation.tools,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                add_generation_prompt=generation_prompt,
                **self.chat_template_kwargs,
            )
        except Exception as exc:  # as in render()
            raise TemplateMismatch(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        ids = list(out["input_ids"])
        blocks = _runs(list(out["assistant_masks"]))
        assistants = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
        if len(blocks) != len(assistants):
            raise TemplateMismatch(f"{len(blocks)} generation blocks for {len(assistants)} assistant messages")
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


def fast_piece_mask(encoding: Any, piece: Piece) -> list[int]:
    """The 0/1 mask of a piece's fast-tokenizer ``Encoding``: its tokens that start inside the spans."""
    mask = [0] * len(encoding.ids)
    for start, end in token_mask(encoding, piece.spans):
        mask[start:end] = [1] * (end - start)
    return mask


def slow_piece_tokens(tokenizer: Any, piece: Piece) -> tuple[list[int], list[int]]:
    """A piece's token ids and mask without offsets: the piece tokenized in segments cut at its span
    edges, which must concatenate to the piece's own tokenization (else :class:`TemplateMismatch`)."""

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    text = piece.text
    if not piece.spans:
        ids = encode(text)
        return ids, [0] * len(ids)
    segments: list[tuple[int, int, int]] = []  # start, end, masked
    at = 0
    for start, end in piece.spans:
        if start > at:
            segments.append((at, start, 0))
        segments.append((start, end, 1))
        at = end
    if at < len(text):
        segments.append((at, len(text), 0))
    parts = [(encode(text[start:end]), masked, end) for start, end, masked in segments]
    ids = [token for part, _, _ in parts for token in part]
    whole = encode(text) if len(parts) > 1 else ids  # one segment is the piece itself
    if ids != whole:
        # The segments before the first that differs match the whole: the merge crosses that one's end.
        at = 0
        for part, _, edge in parts:  # noqa: B007 - `edge` names the differing segment after the loop
            if whole[at : at + len(part)] != part:
                break
            at += len(part)
        raise TemplateMismatch(
            f"the tokenizer joins the text on both sides of character {edge} into one token "
            f"({text[max(0, edge - 12) : edge]!r} | {text[edge : edge + 12]!r}), so no token boundary lies at the edge "
            "of a trained span"
        )
    mask = [masked for part, masked, _ in parts for _ in part]
    return ids, mask


def tokenize_row(renderer: ChatRenderer, row: Row) -> tuple[list[int], list[int]]:
    """Token ids and 0/1 loss mask of one row: fast tokenizers by offsets, slow ones by segments."""
    ids, mask = list(row.ids), list(row.mask)
    if renderer.fast:
        encodings = renderer.tokenizer.backend_tokenizer.encode_batch(
            [p.text for p in row.pieces], add_special_tokens=False
        )
        for piece, encoding in zip(row.pieces, encodings, strict=True):
            ids += encoding.ids
            mask += fast_piece_mask(encoding, piece)
    else:
        for piece in row.pieces:
            piece_ids, piece_mask = slow_piece_tokens(renderer.tokenizer, piece)
            ids += piece_ids
            mask += piece_mask
    return ids, mask


def tokenize_conversation(renderer: ChatRenderer, conversation: Conversation) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and its 0/1 loss mask (one conversation, no batching)."""
    return tokenize_row(renderer, renderer.row(conversation))
