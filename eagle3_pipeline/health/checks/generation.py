"""`generation`: every server work is sent to answers a real 1-token completion in time.

A plain `/health` is not enough: it answers while generation is hung. One check covers all the
targets (each configured endpoint, the embedded server once up, the monitored server); its status
is the worst of theirs. Hosted targets are asked at most once per interval: in between, their
last verdict is reused with its age (`GenerationCache`, carried between ticks in `TickState`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from eagle3_pipeline.health.http import CONNECT_TIMEOUT_S, http_client, redact
from eagle3_pipeline.health.report import Status, Verdict, worst_first
from eagle3_pipeline.health.settings import GenerationTarget
from eagle3_pipeline.hosts.tunnel import reach

__all__ = ["CachedVerdict", "combine", "probe_generation", "reuse"]


@dataclass(frozen=True)
class CachedVerdict:
    """A hosted target's last verdict and when it was taken (epoch seconds); JSON-friendly."""

    status: Status
    detail: str
    taken_at: float

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status.value, "detail": self.detail, "taken_at": self.taken_at}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CachedVerdict:
        return cls(Status(data["status"]), str(data["detail"]), float(data["taken_at"]))


def reuse(target: GenerationTarget, cached: CachedVerdict | None, now: float, interval_s: float) -> Verdict | None:
    """The cached verdict of a hosted target while it is younger than `interval_s`, else None."""
    if not target.hosted or cached is None or not 0 <= now - cached.taken_at < interval_s:
        return None
    age = now - cached.taken_at
    data = {"cached": True, "age_s": round(age, 1)}
    detail = f"{cached.detail} (probed {age:.0f} s ago; hosted, at most every {interval_s:g} s)"
    return Verdict(cached.status, detail, data)


def probe_generation(target: GenerationTarget, timeout_s: float) -> Verdict:
    """A real 1-token chat completion (or `/health_generate`) must answer within `timeout_s`."""
    if target.api_key_env is not None and not target.api_key:
        return Verdict(Status.CRITICAL, f"{target.label}: API key variable {target.api_key_env} is not set")
    url = target.probe_url
    started = time.monotonic()
    try:
        with http_client(timeout_s, target.api_key) as client:
            if target.probe == "chat":
                response = client.post(reach(url), json=_one_token_request(target))
            else:
                response = client.get(reach(url))
    except httpx.ConnectTimeout:
        return Verdict(Status.UNKNOWN, f"could not connect to {url} within {min(timeout_s, CONNECT_TIMEOUT_S):g} s")
    except httpx.ConnectError as exc:
        if "refused" in str(exc).lower():
            return Verdict(Status.CRITICAL, f"connection refused for {url} (server not listening)")
        return Verdict(Status.UNKNOWN, redact(f"cannot connect to {url}: {exc}", target.api_key))
    except httpx.TimeoutException:
        return Verdict(Status.CRITICAL, f"no answer from {url} within {timeout_s:g} s (generation hung?)")
    except httpx.HTTPError as exc:
        return Verdict(Status.CRITICAL, redact(f"{url} failed: {type(exc).__name__}: {exc}", target.api_key))
    return _verdict(response, url, time.monotonic() - started, target)


def _one_token_request(target: GenerationTarget) -> dict[str, Any]:
    return {
        "model": target.model,
        "messages": [{"role": "user", "content": "Reply with OK."}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
    }


def _verdict(response: httpx.Response, url: str, latency: float, target: GenerationTarget) -> Verdict:
    """Bodies are never quoted: a hosted API's error body can echo the request's credentials."""
    data = {"http_status": response.status_code, "latency_s": round(latency, 3)}
    code = response.status_code
    if code == 429:
        return Verdict(Status.WARN, f"HTTP 429 from {url} (rate limited)", data)
    if code != 200:
        hint = {401: " (check the API key)", 403: " (check the API key)", 404: " (check the model name and URL)"}
        return Verdict(Status.CRITICAL, f"HTTP {code} from {url}{hint.get(code, '')}", data)
    if target.probe == "chat" and not _has_choice(response):
        return Verdict(Status.CRITICAL, f"{url} answered 200 without a completion", data)
    what = "1-token completion" if target.probe == "chat" else "/health_generate"
    return Verdict(Status.OK, f"{what} from {target.label} in {latency:.2f} s", data)


def _has_choice(response: httpx.Response) -> bool:
    try:
        choices = response.json().get("choices")
    except (ValueError, AttributeError):
        return False
    return isinstance(choices, list) and len(choices) > 0


def combine(results: Sequence[tuple[GenerationTarget, Verdict]]) -> Verdict:
    """One verdict for all targets: the worst status, and the details of the targets that are not
    OK (worst first), or of all of them when every one is."""
    if not results:
        return Verdict(Status.UNKNOWN, "no inference server to probe")
    findings = [(verdict.status, verdict.detail) for _, verdict in results]
    status, detail = worst_first([f for f in findings if f[0] is not Status.OK] or findings)
    data = {
        "endpoints": [
            {"url": target.label, "status": verdict.status.value, "detail": verdict.detail, **verdict.data}
            for target, verdict in results
        ]
    }
    return Verdict(status, detail, data)
