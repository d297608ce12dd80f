"""Fit before you pay: a prompt whose estimated length plus ``max_tokens`` exceeds the target's
``max_seq_len`` is not sent.

With ``generation.length_estimator: tokenizer`` the prompt is rendered with the target's own chat
template (generation prompt included, with the ``chat_template_kwargs`` the server gets) and
tokenized with its tokenizer, fast or slow (Kimi-K2.5's remote-code ``TikTokenTokenizer``, loaded
through :func:`eagle3_pipeline.target.folder.load_tokenizer` with ``target.trust_remote_code``); a
prompt the template cannot render falls back to the character estimate, and is counted. With
``chars`` the tokenizer-free estimate of the prompts phase is used (4 characters a token).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.generation.prompts import estimate_tokens
from eagle3_pipeline.records import PromptRecord, wire_message
from eagle3_pipeline.target.folder import TargetError, load_tokenizer


@dataclass(frozen=True)
class LengthCheck:
    """Which prompts fit, which do not, and how that was estimated."""

    estimator: str
    max_seq_len: int
    max_tokens: int
    fits: list[PromptRecord]
    over_length: list[PromptRecord]
    fallbacks: int = 0
    longest: int = 0
    longest_fitting: int = 0  # the longest estimate among the prompts that fit


def _template_lengths(
    prompts: Sequence[PromptRecord],
    tokenizer_name: str,
    trust_remote_code: bool,
    chat_template_kwargs: Mapping[str, Any],
) -> tuple[list[int], int]:
    from jinja2 import TemplateError

    try:
        tokenizer = load_tokenizer(tokenizer_name, trust_remote_code, setting="target.tokenizer")
    except TargetError as exc:
        raise ValueError(
            f"{exc}. It is loaded to estimate prompt lengths: set target.tokenizer to the target's tokenizer, "
            "or set generation.length_estimator: chars"
        ) from None
    texts: list[str | None] = []
    for prompt in prompts:
        try:
            rendered: Any = tokenizer.apply_chat_template(
                [wire_message(m) for m in prompt.messages],
                tools=prompt.tool_schemas(),
                tokenize=False,
                add_generation_prompt=True,
                **chat_template_kwargs,
            )
            texts.append(str(rendered))
        except (TemplateError, TypeError, ValueError, KeyError, IndexError):
            texts.append(None)  # a template that cannot render this prompt: the character estimate
    rendered_texts = [t for t in texts if t is not None]
    # One call for all: a fast tokenizer encodes the batch in parallel, a slow one text by text.
    counts = (
        iter(len(ids) for ids in tokenizer(rendered_texts, add_special_tokens=False)["input_ids"])
        if rendered_texts
        else iter(())
    )
    lengths = [
        next(counts) if text is not None else estimate_tokens(p.messages, p.tools)
        for p, text in zip(prompts, texts, strict=True)
    ]
    return lengths, sum(1 for t in texts if t is None)


def check_lengths(
    prompts: Sequence[PromptRecord],
    max_seq_len: int,
    *,
    max_tokens: int,
    estimator: str,
    tokenizer_name: str | None,
    trust_remote_code: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> LengthCheck:
    """Split ``prompts`` into those whose estimated length + ``max_tokens`` fits ``max_seq_len`` and
    the rest. ``trust_remote_code`` is ``target.trust_remote_code``; ``chat_template_kwargs`` go to
    every render, as the server gets them (Kimi-K2.5: ``{"thinking": False}``)."""
    if estimator == "tokenizer" and tokenizer_name:
        lengths, fallbacks = _template_lengths(
            prompts, tokenizer_name, trust_remote_code, dict(chat_template_kwargs or {})
        )
        name = f"tokenizer:{tokenizer_name}"
    else:
        lengths, fallbacks = [estimate_tokens(p.messages, p.tools) for p in prompts], 0
        name = "chars/4"
    fits, over = [], []
    longest_fitting = 0
    for prompt, tokens in zip(prompts, lengths, strict=True):
        fitting = tokens + max_tokens <= max_seq_len
        (fits if fitting else over).append(prompt)
        longest_fitting = max(longest_fitting, tokens if fitting else 0)
    return LengthCheck(name, max_seq_len, max_tokens, fits, over, fallbacks, max(lengths, default=0), longest_fitting)
