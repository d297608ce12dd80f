"""Kimi's slow tiktoken tokenizer, for the tiny Kimi-K2.5 stand-in checkpoint (remote code).

Copied into the checkpoint folder as ``tokenization_kimi.py`` and loaded by
``AutoTokenizer.from_pretrained(folder, trust_remote_code=True)`` through
``tokenizer_config.json``'s ``auto_map`` (``["tokenization_kimi.TikTokenTokenizer", null]``: no
fast class, no ``tokenizer.json``). It behaves like Kimi-K2.5's own ``tokenization_kimi.py``:

* a :class:`~transformers.PreTrainedTokenizer` (slow: ``is_fast`` is False, no
  ``backend_tokenizer``, no offset mapping) over a ``tiktoken.Encoding`` built from the folder's
  ``tiktoken.model`` rank file (``base64-token rank`` lines) and Kimi's pre-tokenizer regex;
* 256 reserved special-token slots right after the mergeable ranks, named by
  ``added_tokens_decoder`` and ``<|reserved_token_ID|>`` where it names none;
* ``encode(text)`` with no other argument goes straight to tiktoken with
  ``allowed_special="all"``: special tokens written in the text become their single ids. With any
  keyword argument it takes the generic ``PreTrainedTokenizer`` path (added-token split, then
  ``_tokenize``), as the real one does; ``decode(ids)`` likewise;
* ``apply_chat_template`` defaults to ``tokenize=False, add_generation_prompt=True`` (the real
  signature), sorts the keys of ``tools`` recursively and passes the TypeScript declaration of the
  tools to the template as ``tools_ts_str`` (see ``tool_declaration_ts.py``).

Differences from the real file: the rank file is tiny (the fixture learns it), and it is read with
its sha256 as ``expected_hash``: tiktoken caches every file it reads under
``$TMPDIR/data-gym-cache`` keyed by the path alone, so a rank file rewritten at the same path would
otherwise be read stale.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from shutil import copyfile
from typing import Any, ClassVar

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from .tool_declaration_ts import encode_tools_to_typescript_style

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}

# Kimi's pre-tokenizer: Han runs, cased words (minus Han) with English contractions, 1–3 digit
# groups, punctuation runs, newlines and spaces. tiktoken's regex engine supports the
# class-intersection syntax (``&&``).
_PAT_PARTS = (
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
PAT_STR = "|".join(_PAT_PARTS)

# tiktoken panics on very long inputs and is slow on very long runs of (non-)whitespace.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


def _deep_sort(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_sort(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_deep_sort(v) for v in value]
    return value


def _split_runs(text: str, limit: int) -> Iterator[str]:
    """Cut ``text`` so no piece holds more than ``limit`` consecutive (non-)whitespace characters."""
    start, run, in_space = 0, 0, text[:1].isspace()
    for i, char in enumerate(text):
        if char.isspace() != in_space:
            in_space, run = char.isspace(), 1
            continue
        run += 1
        if run > limit:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


class TikTokenTokenizer(PreTrainedTokenizer):
    """Slow tokenizer over ``tiktoken`` (Kimi's ``TikTokenTokenizer``)."""

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names: ClassVar[list[str]] = ["input_ids", "attention_mask"]
    num_reserved_special_tokens = 256
    pat_str = PAT_STR

    def __init__(
        self,
        vocab_file: str,
        bos_token: str = "[BOS]",
        eos_token: str = "[EOS]",
        unk_token: str | None = None,
        pad_token: str | None = None,
        additional_special_tokens: list[str] | None = None,
        added_tokens_decoder: dict[int, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not os.path.isfile(vocab_file):
            raise FileNotFoundError(vocab_file)
        if additional_special_tokens is None:
            additional_special_tokens = [
                "<|im_end|>",
                "<|im_user|>",
                "<|im_assistant|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "[EOT]",
                "<|im_system|>",
                "<|im_middle|>",
            ]
        names = {int(i): str(getattr(t, "content", t)) for i, t in (added_tokens_decoder or {}).items()}
        self.vocab_file = vocab_file
        data = Path(vocab_file).read_bytes()
        mergeable_ranks = load_tiktoken_bpe(vocab_file, expected_hash=hashlib.sha256(data).hexdigest())
        base = len(mergeable_ranks)
        self.special_tokens: dict[str, int] = {
            names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + self.num_reserved_special_tokens)
        }
        self.model = tiktoken.Encoding(
            name=Path(vocab_file).name,
            pat_str=self.pat_str,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words: int = self.model.n_vocab
        self.bos_id: int = self.special_tokens[str(bos_token)]
        self.eos_id: int = self.special_tokens[str(eos_token)]
        self.pad_id: int = self.special_tokens[str(pad_token)]
        self.unk_id: int = self.special_tokens[str(unk_token)]

        # Token strings in the GPT-2 byte-to-unicode alphabet, so that convert_ids_to_tokens gives
        # printable strings and convert_tokens_to_string can undo them.
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.decoder: dict[int, str] = {
            i: "".join(self.byte_encoder[b] for b in self.model.decode_single_token_bytes(i))
            for i in range(self.n_words)
        }
        self.encoder: dict[str, int] = {token: i for i, token in self.decoder.items()}

        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            additional_special_tokens=additional_special_tokens,
            added_tokens_decoder=added_tokens_decoder,
            **kwargs,
        )

    # -- the tiktoken fast path -------------------------------------------------------------------

    def encode(self, text: Any, allow_special_tokens: bool = True, **kwargs: Any) -> list[int]:  # type: ignore[override]
        """Token ids of ``text``; special tokens written in it become their ids (``allowed_special="all"``).

        With any keyword argument (``add_special_tokens=…``, ``truncation=…``, a text pair, …) this
        is ``PreTrainedTokenizer.encode``, as in Kimi's tokenizer.
        """
        if kwargs:
            return super().encode(text, **kwargs)
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        special: dict[str, Any] = {"allowed_special": "all"} if allow_special_tokens else {"disallowed_special": ()}
        ids: list[int] = []
        for i in range(0, len(text), _MAX_ENCODE_CHARS):
            for piece in _split_runs(text[i : i + _MAX_ENCODE_CHARS], _MAX_RUN_CHARS):
                ids.extend(self.model.encode(piece, **special))
        return ids

    def decode(self, token_ids: Any, **kwargs: Any) -> str | list[str]:  # type: ignore[override]
        """Text of ``token_ids`` (special tokens included); with keyword arguments the generic path."""
        if kwargs:
            return super().decode(token_ids, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.model.decode([int(i) for i in token_ids])

    # -- what PreTrainedTokenizer needs -----------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [self.decoder[i] for i in self.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.unk_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")

    @staticmethod
    def clean_up_tokenization(out_string: str) -> str:
        return out_string

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        if not os.path.isdir(save_directory):
            raise ValueError(f"vocabulary path ({save_directory}) should be a directory")
        target = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            copyfile(self.vocab_file, target)
        return (target,)

    # -- chat -------------------------------------------------------------------------------------

    def apply_chat_template(  # type: ignore[override]
        self,
        conversation: Any,
        tools: list[Any] | None = None,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Kimi's defaults (a string, with the generation prompt) and the TypeScript tool declaration."""
        tools = _deep_sort(tools)
        if tools and "tools_ts_str" not in kwargs:
            try:
                kwargs["tools_ts_str"] = encode_tools_to_typescript_style(tools)
            except ValueError:
                pass  # the template declares the tools as compact JSON instead
        return super().apply_chat_template(
            conversation, tools=tools, tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs
        )
