"""The HTTP client every server probe uses: bounded timeouts, no proxy from the environment, and
the API key (when there is one) only in the Authorization header, never in a message."""

from __future__ import annotations

import httpx

__all__ = ["CONNECT_TIMEOUT_S", "http_client", "redact"]

CONNECT_TIMEOUT_S = 5.0
REDACTED = "***"


def http_client(timeout_s: float, api_key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S))
    return httpx.Client(timeout=timeout, headers=headers, trust_env=False)


def redact(text: str, api_key: str | None) -> str:
    """`text` with the key replaced, for anything reported (exception texts can echo requests)."""
    return text.replace(api_key, REDACTED) if api_key else text
