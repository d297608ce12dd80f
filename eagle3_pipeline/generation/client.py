"""One attempt at one chat completion: send it, classify what came back.

An attempt ends as a :class:`Completion` or an :class:`AttemptFailure` that says whether another
attempt may help. Every reason text passes through the endpoint's redaction, and bodies of 401/403
answers (where servers echo credentials) are never quoted.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from eagle3_pipeline.generation.endpoints import Endpoint
from eagle3_pipeline.generation.retry import is_retryable_status, parse_retry_after
from eagle3_pipeline.records import Message, wire_message

CHARS_PER_TOKEN = 4
EXCERPT_CHARS = 200
AUTH_STATUSES = frozenset({401, 403})


@dataclass(frozen=True)
class Completion:
    """One assistant message as the server returned it, and what it cost."""

    content: str | None
    reasoning: str | None
    tool_calls: str | None  # JSON text of the message's tool_calls list
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    usage_estimated: bool
    cost: float | None
    latency_s: float
    model: str
    endpoint: str

    @property
    def text(self) -> str:
        """The summary text: the content, or the tool calls' JSON when the turn only called tools."""
        return self.content or self.tool_calls or ""


@dataclass(frozen=True)
class AttemptFailure:
    reason: str
    retryable: bool
    status: int | None = None
    retry_after_s: float | None = None
    # "empty": the server answered, but with no content and no tool calls; "connection": no connection, or
    # it was reset or dropped before an answer; "timeout": no answer in time; "server_error": an HTTP 5xx
    # (vLLM answers the requests in flight so when its engine died, then exits; the last three: how a dead
    # or hung server fails, see .recovery); "error": any other failure
    kind: str = "error"


def request_body(
    endpoint: Endpoint,
    messages: Sequence[Message],
    tools: list[dict[str, Any]] | None,
    max_tokens: int,
    temperature: float,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The chat-completions body; ``chat_template_kwargs`` (SGLang's and vLLM's extension, e.g.
    Kimi-K2.5's ``{"thinking": false}``) only when set."""
    wire = [wire_message(m) for m in messages]
    body: dict[str, Any] = {
        "model": endpoint.model,
        "messages": wire,
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    if tools:
        body["tools"] = tools
    if chat_template_kwargs:
        body["chat_template_kwargs"] = dict(chat_template_kwargs)
    return body


async def attempt_completion(
    client: httpx.AsyncClient, endpoint: Endpoint, body: dict[str, Any], prompt_tokens_est: int
) -> Completion | AttemptFailure:
    started = time.perf_counter()
    try:
        reply = await client.post(endpoint.chat_url, json=body, headers=endpoint.headers())
    except httpx.TimeoutException as exc:
        return AttemptFailure(
            f"{type(exc).__name__}: no answer from {endpoint.base_url} in time", retryable=True, kind="timeout"
        )
    except httpx.HTTPError as exc:
        detail = f": {exc}" if str(exc) else " (connection dropped)"
        return AttemptFailure(
            _excerpt(endpoint, f"{type(exc).__name__} talking to {endpoint.base_url}{detail}"),
            retryable=True,
            kind="connection" if isinstance(exc, httpx.NetworkError | httpx.RemoteProtocolError) else "error",
        )
    latency = time.perf_counter() - started
    if reply.status_code != 200:
        return _status_failure(endpoint, reply)
    try:
        payload = reply.json()
    except ValueError:
        return AttemptFailure(
            f"HTTP 200 from {endpoint.base_url} with a body that is not JSON (truncated?)", retryable=True, status=200
        )
    return parse_completion(payload, endpoint, latency, prompt_tokens_est)


def parse_completion(
    payload: Any, endpoint: Endpoint, latency_s: float, prompt_tokens_est: int
) -> Completion | AttemptFailure:
    """An OpenAI chat completion → :class:`Completion`. Usage a server leaves out is estimated from
    the text and flagged; the cost is the response's ``usage.cost`` if present, else the price table's.
    An answer with no content (once the reasoning is split off) and no tool calls is a retryable
    failure of kind ``empty``: a reasoning model that spent ``max_tokens`` thinking said nothing."""
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict) and "choices" not in payload:
        return _payload_error(endpoint, payload["error"])
    try:
        choice = payload["choices"][0]
        message = choice["message"]
        content = message.get("content")
        calls = message.get("tool_calls") or None
        reasoning = message.get("reasoning_content") or message.get("reasoning") or None
        raw_usage = payload.get("usage")
        usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
        finish_reason = str(choice.get("finish_reason") or "")
    except (KeyError, IndexError, TypeError, AttributeError):
        reason = f"answer from {endpoint.base_url} is not an OpenAI chat completion (no choices[0].message)"
        return AttemptFailure(reason, retryable=False, status=200)
    if content is not None and not isinstance(content, str):
        return AttemptFailure(
            f"answer from {endpoint.base_url} has a content that is not text", retryable=False, status=200
        )
    if not (content or "").strip() and not calls:
        reason = (
            f"empty answer from {endpoint.base_url} "
            f"(finish_reason {finish_reason or 'none'}, no content and no tool calls)"
        )
        return AttemptFailure(reason, retryable=True, status=200, kind="empty")
    tool_calls = json.dumps(calls, ensure_ascii=False) if calls else None
    prompt_tokens, completion_tokens = _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))
    estimated = prompt_tokens is None or completion_tokens is None
    if prompt_tokens is None:
        prompt_tokens = prompt_tokens_est
    if completion_tokens is None:
        completion_tokens = math.ceil(
            (len(content or "") + len(tool_calls or "") + len(reasoning or "")) / CHARS_PER_TOKEN
        )
    cost = _float(usage.get("cost"))
    if cost is None and endpoint.price is not None:
        cost = endpoint.price.cost(prompt_tokens, completion_tokens)
    return Completion(
        content=content or None,
        reasoning=str(reasoning) if reasoning else None,
        tool_calls=tool_calls,
        finish_reason=finish_reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        usage_estimated=estimated,
        cost=cost,
        latency_s=latency_s,
        model=str(payload.get("model") or endpoint.model),
        endpoint=endpoint.base_url,
    )


def _status_failure(endpoint: Endpoint, reply: httpx.Response) -> AttemptFailure:
    status = reply.status_code
    where = f"HTTP {status} from {endpoint.base_url}"
    if status in AUTH_STATUSES:
        return AttemptFailure(f"{where}: the server refused the credentials", retryable=False, status=status)
    detail = _error_message(reply)
    reason = _excerpt(endpoint, f"{where}: {detail}" if detail else where)
    retry_after = parse_retry_after(reply.headers.get("retry-after"))
    kind = "server_error" if status >= 500 else "error"
    return AttemptFailure(
        reason, retryable=is_retryable_status(status), status=status, retry_after_s=retry_after, kind=kind
    )


def _payload_error(endpoint: Endpoint, error: dict[str, Any]) -> AttemptFailure:
    """A 200 answer that carries an ``error`` object instead of choices (hosted routers do this)."""
    code = _int(error.get("code"))
    if code in AUTH_STATUSES:
        return AttemptFailure(
            f"error {code} from {endpoint.base_url}: the server refused the credentials", retryable=False, status=code
        )
    reason = _excerpt(
        endpoint,
        f"error {code if code is not None else '(no code)'} from {endpoint.base_url}: {error.get('message', '')}",
    )
    return AttemptFailure(reason, retryable=code is None or is_retryable_status(code), status=code)


def _error_message(reply: httpx.Response) -> str:
    try:
        payload = reply.json()
    except ValueError:
        return reply.text.strip()
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return json.dumps(payload, ensure_ascii=False)


def _excerpt(endpoint: Endpoint, text: str) -> str:
    text = endpoint.redact(" ".join(text.split()))
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
