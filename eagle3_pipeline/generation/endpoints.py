"""Where requests go: OpenAI-compatible endpoints, and a pool that spreads requests over them by
least outstanding requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from eagle3_pipeline.hosts.tunnel import reach

REDACTED = "***"


@dataclass(frozen=True)
class Price:
    """What an endpoint charges per million tokens."""

    prompt_per_mtok: float
    completion_per_mtok: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.prompt_per_mtok + completion_tokens * self.completion_per_mtok) / 1_000_000


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server. The API key is kept out of ``repr`` and every message."""

    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    price: Price | None = None

    @property
    def chat_url(self) -> str:
        """Where requests go: the chat route, through this process's tunnel to the server when it has one."""
        return reach(self.base_url.rstrip("/") + "/chat/completions")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def redact(self, text: str) -> str:
        """`text` with this endpoint's API key replaced, for anything that is logged or stored."""
        return text.replace(self.api_key, REDACTED) if self.api_key else text


@dataclass
class _Slot:
    endpoint: Endpoint
    outstanding: int = 0
    sent: int = 0
    failed: int = 0
    peak: int = 0


class EndpointPool:
    """Hands each request to the endpoint with the fewest requests outstanding; ties go to the one
    that has been sent the fewest. A retry can avoid the endpoint that just failed it."""

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        if not endpoints:
            raise ValueError("an endpoint pool needs at least one endpoint")
        self._slots = [_Slot(e) for e in endpoints]
        self._active = self._slots

    def use_only(self, endpoint: Endpoint) -> None:
        """From now on hand out only ``endpoint`` (failover: one backend at a time)."""
        self._active = [s for s in self._slots if s.endpoint is endpoint]

    def acquire(self, avoid: Endpoint | None = None) -> Endpoint:
        candidates = [s for s in self._active if s.endpoint is not avoid] or self._active
        slot = min(candidates, key=lambda s: (s.outstanding, s.sent))
        slot.outstanding += 1
        slot.sent += 1
        slot.peak = max(slot.peak, slot.outstanding)
        return slot.endpoint

    def release(self, endpoint: Endpoint, ok: bool) -> None:
        for slot in self._slots:
            if slot.endpoint is endpoint:
                slot.outstanding -= 1
                slot.failed += 0 if ok else 1
                return

    def redact(self, text: str) -> str:
        for slot in self._slots:
            text = slot.endpoint.redact(text)
        return text

    def stats(self) -> list[dict[str, Any]]:
        return [
            {
                "endpoint": s.endpoint.base_url,
                "model": s.endpoint.model,
                "requests": s.sent,
                "failed_attempts": s.failed,
                "peak_in_flight": s.peak,
            }
            for s in self._slots
        ]


def tokenize_url(base_url: str) -> str:
    """The tokenize route at the server's root for an OpenAI base URL (``http://host:port/v1`` →
    ``http://host:port/tokenize``): SGLang and vLLM both serve ``POST /tokenize`` there."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit(parts._replace(path=f"{path}/tokenize", query="", fragment=""))
