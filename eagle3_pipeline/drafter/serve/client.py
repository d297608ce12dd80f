"""The benchmark's requests: streamed, greedy, by token ids, one record per request, and τ from the engine.

Each request streams so that its time to first token and inter-token latency are seen, and its tokens are
counted by the engine, never by splitting text:
- SGLang's native ``/generate`` with ``stream``: each ``data:`` chunk carries ``meta_info.completion_tokens``
  (the tokens so far) and ``output_ids``, and the last one ``spec_verify_ct`` (left out when 0: a request
  answered without a verify step, counted apart as ``no_verify_requests``);
- vLLM's ``/v1/completions`` with ``stream``, ``return_token_ids`` (each chunk's ``choices[0].token_ids`` are
  the new tokens) and ``stream_options.include_usage`` (the last chunk's ``usage.completion_tokens``).
τ: SGLang Σ completion_tokens / Σ spec_verify_ct over the requests with a verify step (SpecForge's figure);
vLLM 1 + Δaccepted / Δdrafts from ``/metrics`` around the measurement, and per draft position ``p``
Δ``…_per_pos{position="p"}`` / Δdrafts (vLLM ``v1/spec_decode/metrics.py``, ``SpecDecodingProm``).
Inter-token latency of a request: (last token's arrival − first token's) / (tokens − 1), the mean gap a
reader sees, which counts a verify step that lands several tokens at once as several short gaps.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from statistics import fmean
from typing import Any

import httpx

from eagle3_pipeline.drafter.serve.set_tau import Completion
from eagle3_pipeline.hosts import reach

VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


class BenchmarkError(RuntimeError):
    """A server that did not start, died, or reported no speculative statistics."""


@dataclass(frozen=True)
class RequestRecord:
    """One streamed request: which prompt, what came back (the engine's count, ids and text) and when."""

    prompt: int  # index into the prompts sent
    completion_tokens: int
    token_ids: list[int]
    text: str
    latency_s: float  # from sending to the last token
    ttft_s: float | None  # to the first token (None: no token came back)
    last_token_s: float | None  # to the last token
    verify_steps: int | None = None  # SGLang's spec_verify_ct (None: not reported)

    @property
    def itl_s(self) -> float | None:
        """Mean gap between tokens after the first (None for fewer than two tokens)."""
        if self.completion_tokens < 2 or self.ttft_s is None or self.last_token_s is None:
            return None
        return (self.last_token_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.latency_s if self.latency_s > 0 else 0.0


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters at one scrape, summed over their label sets (engines)."""

    accepted: float
    drafts: float
    per_position: tuple[float, ...]  # accepted tokens at draft position 0, 1, …; () when not exported

    def since(self, before: SpecCounters) -> SpecCounters:
        """The increase from ``before`` (per position only where both scrapes list the same positions)."""
        same = len(self.per_position) == len(before.per_position)
        return SpecCounters(
            self.accepted - before.accepted,
            self.drafts - before.drafts,
            tuple(now - then for now, then in zip(self.per_position, before.per_position, strict=True)) if same else (),
        )


@dataclass(frozen=True)
class Acceptance:
    """τ as the server reports it, and per draft position where the server says."""

    tau: float
    per_position: list[float] | None  # P(a verify step accepts >= p + 1 drafts), p = 0 … K-1
    verify_steps: int | None = None  # vLLM's drafts (SGLang's spec_verify_ct)
    accepted_tokens: int | None = None
    no_verify_requests: int = 0  # requests answered with no verify step (SGLang: no spec_verify_ct)


@dataclass(frozen=True)
class Measured:
    """Prompts sent to one server at one concurrency: every request's record, the wall time, τ when it speculates."""

    concurrency: int
    records: list[RequestRecord]
    wall_s: float
    acceptance: Acceptance | None

    @property
    def requests(self) -> int:
        return len(self.records)

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.records)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens/s overall: all completion tokens over the wall time."""
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The figures kept in records and metadata (the requests' ids and text stay in memory)."""
        ttft = [r.ttft_s for r in self.records if r.ttft_s is not None]
        itl = [i for r in self.records if (i := r.itl_s) is not None]
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "completion_tokens": self.completion_tokens,
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "tokens_per_s_per_request": round(fmean(r.tokens_per_s for r in self.records), 3) if self.records else 0.0,
            "ttft_s": round(fmean(ttft), 4) if ttft else None,
            "itl_s": round(fmean(itl), 5) if itl else None,
        }


def _events(reply: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON of each server-sent ``data:`` line up to ``[DONE]``."""
    for line in reply.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class Client:
    """Streamed greedy requests by token ids, in the server's own protocol (``server``: sglang or vllm)."""

    def __init__(self, server: str, base_url: str, timeout_s: float, api_key: str | None = None) -> None:
        self.server = server
        self.root = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout_s, headers=headers, limits=httpx.Limits(max_connections=None))
        self.model: str | None = None

    def url(self, path: str) -> str:
        """Where a request for ``path`` goes: through this process's tunnel to the server when it has one."""
        return reach(self.root + path)

    def close(self) -> None:
        self.http.close()

    def _request(self, prompt: Sequence[int], max_tokens: int) -> tuple[str, dict[str, Any]]:
        if self.server == "sglang":
            sampling = {"max_new_tokens": max_tokens, "temperature": 0.0}
            return "/generate", {"input_ids": list(prompt), "sampling_params": sampling, "stream": True}
        if self.model is None:
            models = self.http.get(self.url("/v1/models"))
            models.raise_for_status()
            self.model = str(models.json()["data"][0]["id"])
        body = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        return "/v1/completions", body

    def complete(self, prompt: Sequence[int], max_tokens: int, index: int = 0) -> RequestRecord:
        """One streamed request; its tokens as the engine counts them, its first and last token's times."""
        path, body = self._request(prompt, max_tokens)
        ids: list[int] = []
        text = ""
        count = 0
        verify: int | None = None
        first: float | None = None
        last: float | None = None
        started = time.monotonic()
        with self.http.stream("POST", self.url(path), json=body) as reply:
            reply.raise_for_status()
            for event in _events(reply):
                now = time.monotonic() - started
                before = count
                if self.server == "sglang":
                    meta = event.get("meta_info") or {}
                    count = int(meta.get("completion_tokens", count))
                    verify = meta.get("spec_verify_ct", verify)
                    new_ids = list(event.get("output_ids") or [])
                    ids = new_ids if len(new_ids) == count else ids + new_ids  # cumulative or incremental
                    chunk = str(event.get("text") or "")
                    text = chunk if chunk.startswith(text) else text + chunk
                else:
                    for choice in event.get("choices") or []:
                        ids += list(choice.get("token_ids") or [])
                        text += str(choice.get("text") or "")
                    usage = event.get("usage") or {}
                    count = int(usage.get("completion_tokens", len(ids)))
                if count > before:
                    first = now if first is None else first
                    last = now
        latency = time.monotonic() - started
        steps = int(verify) if verify else None
        return RequestRecord(index, count, ids, text, latency, first, last, steps)

    def generate(self, prompt: Sequence[int], max_tokens: int) -> Completion:
        """One greedy request's token ids and text (a prompt set's request: :class:`set_tau.Engine`)."""
        record = self.complete(prompt, max_tokens)
        return Completion(tuple(record.token_ids), record.text, record.verify_steps)

    def counters(self) -> SpecCounters:
        return self.spec_counters()

    def spec_counters(self) -> SpecCounters:
        """vLLM's accepted-token and draft counters, and the accepted tokens per draft position."""
        from prometheus_client.parser import text_string_to_metric_families

        reply = self.http.get(self.url("/metrics"))
        reply.raise_for_status()
        sums = {VLLM_ACCEPTED: 0.0, VLLM_DRAFTS: 0.0}
        positions: dict[int, float] = {}
        for family in text_string_to_metric_families(reply.text):
            for sample in family.samples:
                name = sample.name.removesuffix("_total")
                if name in sums:
                    sums[name] += sample.value
                elif name == VLLM_ACCEPTED_PER_POSITION and sample.labels.get("position", "").isdigit():
                    position = int(sample.labels["position"])
                    positions[position] = positions.get(position, 0.0) + sample.value
        contiguous = sorted(positions) == list(range(len(positions)))
        per_position = tuple(positions[p] for p in range(len(positions))) if contiguous else ()
        return SpecCounters(sums[VLLM_ACCEPTED], sums[VLLM_DRAFTS], per_position)


def requests_at(prompts: Sequence[Sequence[int]], concurrency: int) -> list[int]:
    """The prompt of each request at ``concurrency``: every prompt once, cycled until ``concurrency`` are in
    flight at once (fewer prompts than that would never load the server to it)."""
    return [i % len(prompts) for i in range(max(len(prompts), concurrency))]


def measure(
    server: str,
    base_url: str,
    *,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    timeout_s: float,
    speculative: bool,
    api_key: str | None = None,
) -> Measured:
    """``prompts`` sent greedily to a running server (``server``: sglang or vllm) at ``concurrency``
    (:func:`requests_at`); with ``speculative``, τ as the server reports it (module doc): the served
    drafter's figure too. ``api_key``: the key a managed server requires (``serving.api_key_env``)."""
    client = Client(server, base_url, timeout_s, api_key)
    try:
        before = client.spec_counters() if speculative and server == "vllm" else None
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            records = list(
                pool.map(lambda i: client.complete(prompts[i], max_tokens, i), requests_at(prompts, concurrency))
            )
        wall = time.monotonic() - started
        acceptance = acceptance_of(server, client, records, before) if speculative else None
    finally:
        client.close()
    return Measured(concurrency, records, round(wall, 3), acceptance)


def acceptance_of(
    server: str, client: Client, records: Sequence[RequestRecord], before: SpecCounters | None
) -> Acceptance:
    """τ over ``records`` (SGLang) or the counters' increase since ``before`` (vLLM)."""
    if server == "sglang":
        verified = [r for r in records if r.verify_steps]
        if not verified:
            raise BenchmarkError(
                f"SGLang reported no spec_verify_ct in meta_info for any of {len(records)} request(s): is "
                "speculative decoding on?"
            )
        steps = sum(int(r.verify_steps or 0) for r in verified)
        tokens = sum(r.completion_tokens for r in verified)
        return Acceptance(tokens / steps, None, steps, no_verify_requests=len(records) - len(verified))
    assert before is not None
    delta = client.spec_counters().since(before)
    if delta.drafts <= 0:
        raise BenchmarkError(f"vLLM's {VLLM_DRAFTS} did not advance: is speculative decoding on?")
    per_position = [accepted / delta.drafts for accepted in delta.per_position] or None
    no_verify = sum(1 for r in records if r.completion_tokens <= 1)
    return Acceptance(
        1.0 + delta.accepted / delta.drafts, per_position, int(delta.drafts), int(delta.accepted), no_verify
    )
