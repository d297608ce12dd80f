"""What a dataset needs of its server, checked once before the partition's requests go out.

A server started without the flag a dataset needs answers every request of it the same way: vLLM
without ``--enable-auto-tool-choice --tool-call-parser`` refuses each request that carries tools
(HTTP 400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be
set'), SGLang without ``--tool-call-parser`` accepts them and returns the model's tool calls as
plain text. :func:`probe_capabilities` asks each endpoint the partition will use for the
capabilities the dataset needs, with requests of at most a few tokens:

- ``tool_call_parser`` (the dataset's prompts carry tools): one request with the dataset's tools,
  shaped like the partition's requests (no ``tool_choice``: vLLM then takes ``auto``, as it does
  for every request of the run); a 400/422 answer is the missing parser. A 200 answer is checked
  against SGLang's server info (``GET /server_info``, older ``/get_server_info``: its server args,
  ``tool_call_parser`` among them), since SGLang answers 200 either way.
- ``reasoning_parser`` (``generation.reasoning: keep``): a short question; reasoning in
  ``reasoning_content``/``reasoning`` is the parser at work, ``<think>`` markup in the content is
  the parser missing. SGLang's server info naming a ``reasoning_parser`` is enough. A model that
  did not think in the probe's few tokens gives no evidence either way: UNKNOWN, said why.
- ``context_length``: ``max_model_len`` of the served model in ``GET /v1/models`` (vLLM and SGLang
  both report it) at least the longest prompt's estimate plus ``max_tokens``.
- ``tokenize`` (``training_data.tokenizer_check_samples`` > 0 against endpoints): ``POST /tokenize``
  at the server's root. Advisory: without it training_data reports the tokenizer agreement as
  "not checked" (as it does for a hosted API), so its absence does not fail the partition.

Only positive evidence of absence fails the partition (:class:`CapabilityMissing`, whose message
names the flag to add for vLLM and for SGLang). A server that does not say — a hosted API has no
server info, reports no ``max_model_len`` and no tokenize route — is UNKNOWN, reported, not refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from eagle3_pipeline.generation.client import request_body
from eagle3_pipeline.generation.endpoints import Endpoint, tokenize_url
from eagle3_pipeline.hosts.tunnel import reach
from eagle3_pipeline.records import normalized

Status = Literal["ok", "missing", "unknown"]
PROBE_PREFIX = "Capability probe"  # the probes' chat requests start their user turn with it
PROBE_TIMEOUT_S = 60.0
# Enough for a thinking model to show its first reasoning words (or its <think> markup).
REASONING_PROBE_TOKENS = 16
THINK_MARKUP = ("<think>", "</think>")
SERVER_INFO_ROUTES = ("/server_info", "/get_server_info")
REFUSED = frozenset({400, 422})
EXCERPT_CHARS = 240

TOOL_FLAGS = (
    "start vLLM with --enable-auto-tool-choice --tool-call-parser <name>; SGLang with --tool-call-parser <name> "
    "(<name>: the parser of the target's tool-call format, e.g. kimi_k2, hermes, llama3_json)"
)
REASONING_FLAGS = (
    "start vLLM with --reasoning-parser <name>; SGLang with --reasoning-parser <name> "
    "(<name>: the parser of the target's reasoning format, e.g. kimi_k2, deepseek_r1, qwen3)"
)


@dataclass(frozen=True)
class ServerNeeds:
    """What the dataset's requests need of the server."""

    tools: list[dict[str, Any]] | None  # one prompt's tool list: the probe sends it
    reasoning: bool  # generation.reasoning: keep
    context_tokens: int | None  # the longest prompt's estimate + max_tokens; None: no prompt to send
    estimator: str  # how the prompt lengths were estimated
    tokenize: bool  # training_data will ask POST /tokenize
    chat_template_kwargs: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class CapabilityCheck:
    """One capability on one endpoint. ``blocking``: missing, it fails the partition."""

    capability: str
    endpoint: str
    status: Status
    detail: str
    blocking: bool = True

    @property
    def line(self) -> str:
        return f"{self.capability} on {self.endpoint}: {self.status.upper()} ({self.detail})"


@dataclass(frozen=True)
class CapabilityReport:
    checks: list[CapabilityCheck] = field(default_factory=list)

    @property
    def missing(self) -> list[CapabilityCheck]:
        """The missing capabilities that fail the partition."""
        return [c for c in self.checks if c.status == "missing" and c.blocking]

    @property
    def notes(self) -> list[CapabilityCheck]:
        """What the run should say without failing: advisory misses and UNKNOWNs."""
        return [c for c in self.checks if c.status == "unknown" or (c.status == "missing" and not c.blocking)]

    def as_metadata(self) -> list[dict[str, Any]]:
        return [
            {"capability": c.capability, "endpoint": c.endpoint, "status": c.status, "detail": c.detail}
            for c in self.checks
        ]


class CapabilityMissing(RuntimeError):
    """The server lacks a capability the dataset needs; nothing of the partition was sent."""

    def __init__(self, dataset: str, report: CapabilityReport) -> None:
        lines = "; ".join(c.line for c in report.missing)
        super().__init__(
            f"{dataset}: the server lacks what this dataset needs, so no request of the partition was sent: {lines}"
        )
        self.report = report


def root_url(base_url: str) -> str:
    """The server's root for an OpenAI base URL (``http://host:port/v1`` → ``http://host:port``)."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class _Prober:
    """The probes of one endpoint over one HTTP client; SGLang's server info is asked once."""

    def __init__(self, endpoint: Endpoint, needs: ServerNeeds, client: httpx.Client) -> None:
        self.endpoint = endpoint
        self.needs = needs
        self.client = client
        self._server_info: dict[str, Any] | None = None
        self._asked = False

    def check(self, capability: str, status: Status, detail: str, blocking: bool = True) -> CapabilityCheck:
        return CapabilityCheck(capability, self.endpoint.base_url, status, self.endpoint.redact(detail), blocking)

    def server_info(self) -> dict[str, Any] | None:
        """SGLang's server args (None: not SGLang, or it did not say)."""
        if not self._asked:
            self._asked = True
            for route in SERVER_INFO_ROUTES:
                payload = self._get_json(root_url(self.endpoint.base_url) + route)
                if isinstance(payload, dict) and "tool_call_parser" in payload:
                    self._server_info = payload
                    break
        return self._server_info

    def _get_json(self, url: str) -> Any:
        try:
            reply = self.client.get(reach(url), headers=self.endpoint.headers())
            return reply.json() if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def _chat(self, content: str, tools: list[dict[str, Any]] | None, max_tokens: int) -> httpx.Response | str:
        """The answer to one chat request, or why there is none."""
        body = request_body(
            self.endpoint,
            [normalized({"role": "user", "content": content})],
            tools,
            max_tokens,
            0.0,
            self.needs.chat_template_kwargs,
        )
        try:
            return self.client.post(self.endpoint.chat_url, json=body, headers=self.endpoint.headers())
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__} talking to {self.endpoint.base_url}"

    def tools(self) -> CapabilityCheck:
        name = "tool_call_parser"
        reply = self._chat(f"{PROBE_PREFIX}: reply with one word.", self.needs.tools, 1)
        if isinstance(reply, str):
            return self.check(name, "unknown", f"the probe with tools got no answer: {reply}")
        if reply.status_code in REFUSED:
            return self.check(
                name,
                "missing",
                f"HTTP {reply.status_code} to a request with the dataset's tools: {_message(reply)}. {TOOL_FLAGS}",
            )
        if reply.status_code != 200:
            return self.check(name, "unknown", f"HTTP {reply.status_code} to the probe with tools: {_message(reply)}")
        info = self.server_info()
        if info is not None and not info.get("tool_call_parser"):
            return self.check(
                name,
                "missing",
                "SGLang's server info has no tool_call_parser: it would return the model's tool calls as plain "
                f"text. {TOOL_FLAGS}",
            )
        if info is not None:
            return self.check(name, "ok", f"SGLang --tool-call-parser {info['tool_call_parser']}")
        return self.check(name, "ok", "a request with the dataset's tools was accepted")

    def reasoning(self) -> CapabilityCheck:
        name = "reasoning_parser"
        info = self.server_info()
        if info is not None and info.get("reasoning_parser"):
            return self.check(name, "ok", f"SGLang --reasoning-parser {info['reasoning_parser']}")
        reply = self._chat(f"{PROBE_PREFIX}: what is 17 + 25?", None, REASONING_PROBE_TOKENS)
        if isinstance(reply, str):
            return self.check(name, "unknown", f"the reasoning probe got no answer: {reply}")
        if reply.status_code != 200:
            return self.check(name, "unknown", f"HTTP {reply.status_code} to the reasoning probe: {_message(reply)}")
        message = _message_of(reply)
        if message is None:
            return self.check(name, "unknown", "the reasoning probe's answer is not a chat completion")
        if message.get("reasoning_content") or message.get("reasoning"):
            return self.check(name, "ok", "the server returned the model's reasoning apart from its content")
        content = message.get("content")
        markup = [m for m in THINK_MARKUP if isinstance(content, str) and m in content]
        if markup:
            return self.check(
                name,
                "missing",
                f"the model's reasoning came back inside the content ({' and '.join(markup)} in it), so the "
                f"reasoning column would stay empty. {REASONING_FLAGS}",
            )
        return self.check(
            name,
            "unknown",
            f"the probe's answer ({REASONING_PROBE_TOKENS} tokens at most) holds no reasoning and no "
            f"{'/'.join(THINK_MARKUP)} markup: no evidence that this model reasons here, so none about the "
            "server's reasoning parser (a model that does not reason needs none)",
        )

    def context(self) -> CapabilityCheck:
        name = "context_length"
        needed = self.needs.context_tokens
        assert needed is not None
        payload = self._get_json(self.endpoint.base_url.rstrip("/") + "/models")
        cards = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(cards, list):
            return self.check(name, "unknown", "GET /models gave no model list")
        card = next((c for c in cards if isinstance(c, dict) and c.get("id") == self.endpoint.model), None)
        if card is None and len(cards) == 1 and isinstance(cards[0], dict):
            card = cards[0]
        limit = card.get("max_model_len") if card is not None else None
        if not isinstance(limit, int) or isinstance(limit, bool):
            return self.check(
                name,
                "unknown",
                f"GET /models reports no max_model_len for {self.endpoint.model!r} (hosted APIs do not)",
            )
        if limit < needed:
            return self.check(
                name,
                "missing",
                f"the server's max_model_len is {limit}, and the longest prompt with max_tokens needs {needed} "
                f"tokens (estimated by {self.needs.estimator}): start vLLM with --max-model-len {needed} or more; "
                f"SGLang with --context-length {needed} or more (or lower target.max_seq_len or "
                "generation.max_tokens)",
            )
        return self.check(name, "ok", f"max_model_len {limit} ≥ {needed} needed")

    def tokenize(self) -> CapabilityCheck:
        name = "tokenize"
        url = tokenize_url(self.endpoint.base_url)
        body = {"model": self.endpoint.model, "prompt": PROBE_PREFIX, "add_special_tokens": False}
        try:
            reply = self.client.post(reach(url), json=body, headers=self.endpoint.headers())
        except httpx.HTTPError as exc:
            return self.check(name, "unknown", f"{type(exc).__name__} talking to {url}", blocking=False)
        if reply.status_code == 404:
            return self.check(
                name,
                "missing",
                f"POST {url} answered 404: training_data's tokenizer agreement will be 'not checked' "
                "(vLLM and SGLang serve /tokenize; a hosted API does not; training_data.tokenizer_check_samples: 0 "
                "turns the check off)",
                blocking=False,
            )
        try:
            tokens = reply.json().get("tokens") if reply.status_code == 200 else None
        except (ValueError, AttributeError):
            tokens = None
        if isinstance(tokens, list):
            return self.check(name, "ok", f"POST {url} answers token ids", blocking=False)
        return self.check(
            name, "unknown", f"POST {url}: HTTP {reply.status_code}, no token ids: {_message(reply)}", blocking=False
        )


def _message(reply: httpx.Response) -> str:
    try:
        payload = reply.json()
    except ValueError:
        payload = None
    # vLLM: {"error": {"message": ...}}; SGLang: {"object": "error", "message": ...}
    error = payload.get("error") if isinstance(payload, dict) else None
    source = error if isinstance(error, dict) else payload if isinstance(payload, dict) else {}
    text = str(source["message"]) if source.get("message") else reply.text
    text = " ".join(text.split())
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


def _message_of(reply: httpx.Response) -> dict[str, Any] | None:
    try:
        message = reply.json()["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return message if isinstance(message, dict) else None


def probe_capabilities(
    endpoints: Sequence[Endpoint], needs: ServerNeeds, timeout_s: float = PROBE_TIMEOUT_S
) -> CapabilityReport:
    """Ask each endpoint for what ``needs`` says, once; nothing is probed that the dataset does not need."""
    checks: list[CapabilityCheck] = []
    with httpx.Client(timeout=timeout_s) as client:
        for endpoint in endpoints:
            prober = _Prober(endpoint, needs, client)
            if needs.tools:
                checks.append(prober.tools())
            if needs.reasoning:
                checks.append(prober.reasoning())
            if needs.context_tokens is not None:
                checks.append(prober.context())
            if needs.tokenize:
                checks.append(prober.tokenize())
    return CapabilityReport(checks)
