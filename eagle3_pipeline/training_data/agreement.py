"""Does our tokenizer turn rendered text into the ids the server does?

The rows are tokenized by our tokenizer, the hidden states and τ come from the serving stack, which
tokenized the same prompts itself: if the two disagree every row is silently off.
:func:`check_agreement` compares them on N rendered samples, :func:`remote_tokenizer` is the server's
side (its tokenize route), :func:`tokenizer_agreement` runs the check for the ``training_data`` phase
(training_data/DESIGN.md, "Tokenizer agreement").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from eagle3_pipeline.generation.endpoints import tokenize_url
from eagle3_pipeline.hosts.tunnel import reach

# Token positions shown on each side of the first disagreement.
CONTEXT_TOKENS = 4


class TokenizerDisagreement(ValueError):
    """The local tokenizer and the server's give different ids for the same text."""


class RemoteTokenizerError(RuntimeError):
    """The server's tokenize route could not be asked, or answered something other than token ids."""


class TokenizeRouteMissing(RemoteTokenizerError):
    """The server has no tokenize route (HTTP 404): the agreement is not checked."""


@dataclass(frozen=True)
class AgreementResult:
    """How much was compared: every sample agreed token for token."""

    samples: int
    tokens: int


def _window(ids: list[int], at: int, decode: Callable[[list[int]], str] | None) -> str:
    start = max(0, at - CONTEXT_TOKENS)
    shown = ids[start : at + CONTEXT_TOKENS + 1]
    if decode is None:
        return str(shown)
    return "[" + ", ".join(f"{t} {decode([t])!r}" for t in shown) + "]"


def check_agreement(
    texts: Iterable[str],
    local: Callable[[str], list[int]],
    remote: Callable[[str], list[int]],
    decode: Callable[[list[int]], str] | None = None,
) -> AgreementResult:
    """Tokenize each text locally and on the server; raise :class:`TokenizerDisagreement` at the
    first sample whose ids differ, naming the sample's index, the first differing token position,
    and the ids around it on both sides (with their pieces when ``decode`` is given: the local
    tokenizer's ``decode``)."""
    samples = tokens = 0
    for index, text in enumerate(texts):
        mine, theirs = list(local(text)), list(remote(text))
        if mine != theirs:
            at = next(
                (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs))
            )
            where = f"character {len(decode(mine[:at]))} of the text" if decode is not None else "the text"
            raise TokenizerDisagreement(
                f"sample {index}: the local tokenizer and the server's disagree at token {at} ({where}; local "
                f"{len(mine)} tokens, server {len(theirs)}): local {_window(mine, at, decode)} vs server "
                f"{_window(theirs, at, decode)}"
            )
        samples += 1
        tokens += len(mine)
    return AgreementResult(samples, tokens)


class RemoteTokenizer:
    """The server's tokenizer as a callable ``text -> ids`` over one HTTP connection pool; close
    it (or use it as a context manager) when done."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 30.0) -> None:
        import httpx

        self.url = tokenize_url(base_url)
        self.model = model
        self._api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=timeout_s)

    def _safe(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text

    def __call__(self, text: str) -> list[int]:
        import httpx

        # SGLang and vLLM both read "add_special_tokens" beside "model" and "prompt" and default it to
        # true (SGLang 0.5.14/0.5.23: TokenizeRequest in entrypoints/openai/protocol.py, passed to
        # tokenizer.encode in serving_tokenize.py): false, as the rendered text carries the
        # template's special tokens already.
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        try:
            response = self._client.post(reach(self.url), json=body)
        except httpx.HTTPError as exc:
            raise RemoteTokenizerError(self._safe(f"{self.url}: {type(exc).__name__}: {exc}")) from None
        if response.status_code == 404:
            raise TokenizeRouteMissing(
                self._safe(
                    f"{self.url}: HTTP 404, the server has no tokenize route (or does not serve model {self.model!r}): "
                    f"{response.text[:200]}"
                )
            )
        if response.status_code != 200:
            raise RemoteTokenizerError(self._safe(f"{self.url}: HTTP {response.status_code}: {response.text[:200]}"))
        try:
            payload: Any = response.json()
        except ValueError:
            payload = None
        tokens = payload.get("tokens") if isinstance(payload, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RemoteTokenizerError(
                self._safe(
                    f"{self.url}: expected a JSON object with 'tokens', a list of token "
                    f"ids; got {response.text[:200]!r}"
                )
            )
        return tokens

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RemoteTokenizer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def remote_tokenizer(base_url: str, model: str, api_key: str | None = None, timeout_s: float = 30.0) -> RemoteTokenizer:
    """The serving endpoint's tokenizer: ``POST {root}/tokenize`` with ``{"model", "prompt",
    "add_special_tokens": false}`` → ``{"tokens": [...]}`` (SGLang and vLLM), ``base_url`` being the
    endpoint's OpenAI base (``http://host:port/v1``). Errors name the URL, never the API key; a
    missing route (404) is :class:`TokenizeRouteMissing`."""
    return RemoteTokenizer(base_url, model, api_key, timeout_s)


@dataclass(frozen=True)
class ServerEndpoint:
    """A serving endpoint to ask (its OpenAI base URL, the model name it serves, its key if any)."""

    base_url: str
    model: str
    api_key: str | None = None


def rendered_samples(
    response_files: Iterable[Path], tokenizer: Any, count: int, chat_template_kwargs: Mapping[str, Any] | None
) -> list[str]:
    """The first ``count`` conversations of the responses tables, rendered whole by the target's
    chat template (reasoning included, as ``training_data`` hands it over), in file order."""
    import pyarrow.parquet as pq

    from eagle3_pipeline.training_data.build import stored_conversation
    from eagle3_pipeline.training_data.masks import ChatRenderer, TemplateMismatch

    renderer = ChatRenderer(tokenizer, "render", chat_template_kwargs)
    texts: list[str] = []
    for path in response_files:
        for batch in pq.ParquetFile(path).iter_batches(
            batch_size=max(count, 1), columns=["id", "dataset", "messages", "tools"]
        ):
            for row in batch.to_pylist():
                conversation = stored_conversation(row, "render")
                try:
                    texts.append(renderer.render(conversation.messages, conversation.tools))
                except TemplateMismatch:
                    continue  # counted by training_data itself
                if len(texts) == count:
                    return texts
    return texts


def agreement_with_servers(
    texts: list[str], tokenizer: Any, endpoints: Iterable[ServerEndpoint], timeout_s: float = 30.0
) -> dict[str, Any]:
    """Check ``texts`` against the first endpoint that has a tokenize route. Returns what was
    checked (``tokenizer_agreement``: ``ok`` or ``not checked``, with the endpoint or the reason);
    raises :class:`TokenizerDisagreement` on a disagreement. No evidence is not agreement: with no
    endpoint to ask, or none with a tokenize route, the answer is ``not checked`` and why."""
    reasons: list[str] = []
    for endpoint in endpoints:
        try:
            with remote_tokenizer(endpoint.base_url, endpoint.model, endpoint.api_key, timeout_s) as remote:
                result = check_agreement(
                    texts, lambda t: list(tokenizer.encode(t, add_special_tokens=False)), remote, tokenizer.decode
                )
        except RemoteTokenizerError as exc:
            reasons.append(str(exc))
            continue
        return {
            "tokenizer_agreement": "ok",
            "tokenizer_agreement_detail": (
                f"{result.samples} rendered samples, {result.tokens} tokens: "
                f"the same ids locally and from {tokenize_url(endpoint.base_url)}"
            ),
        }
    detail = "; ".join(reasons) if reasons else "no serving endpoint to ask (the embedded server is not running)"
    return {"tokenizer_agreement": "not checked", "tokenizer_agreement_detail": detail}


def tokenizer_agreement(
    response_files: Iterable[Path],
    tokenizer_name: str,
    trust_remote_code: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
    endpoints: Iterable[ServerEndpoint],
    samples: int,
) -> dict[str, Any]:
    """The ``training_data`` preflight: ``samples`` rendered conversations tokenized by the target's
    tokenizer (as the rows are) and by the first serving endpoint with a tokenize route."""
    from eagle3_pipeline.target.folder import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_name, trust_remote_code)
    texts = rendered_samples(response_files, tokenizer, samples, chat_template_kwargs)
    if not texts:
        return {"tokenizer_agreement": "not checked", "tokenizer_agreement_detail": "no conversation to render"}
    return agreement_with_servers(texts, tokenizer, endpoints)
