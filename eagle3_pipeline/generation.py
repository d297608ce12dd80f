"""Response generation: an OpenAI-compatible chat client with bounded async concurrency and a
crash-safe, append-only JSONL checkpoint keyed by prompt id.

Every finished response is appended (one ``write`` of one line) the moment it arrives, so a crash
or a kill loses at most the requests in flight. On start the checkpoint is read back by id: a torn
last line is cut off (its request is redone) and an id finished twice is kept once.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eagle3_pipeline.records import PromptRecord

ERROR_EXAMPLES = 5


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be trusted (corrupt in the middle, not a torn tail)."""


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server. The API key is kept out of ``repr`` and every message."""

    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)

    @property
    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int = 256
    temperature: float = 0.0
    concurrency: int = 8
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    fsync: bool = False


@dataclass(frozen=True)
class Progress:
    done: int
    total: int
    completion_tokens: int
    failed: int
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class GenerationSummary:
    total: int
    already_done: int = 0
    generated: int = 0
    failed: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    error_examples: list[str] = field(default_factory=list)

    def as_metadata(self) -> dict[str, Any]:
        return {
            "prompts": self.total,
            "already_done": self.already_done,
            "generated_now": self.generated,
            "failed": self.failed,
            "new_completion_tokens": self.completion_tokens,
            "generation_seconds": round(self.elapsed_s, 2),
        }


class ResponseCheckpoint:
    """Append-only JSONL of finished responses, one JSON object per line, keyed by ``id``."""

    def __init__(self, path: Path, fsync: bool = False) -> None:
        self.path = path
        self.fsync = fsync

    def load(self) -> dict[str, dict[str, Any]]:
        """Read every finished record; cut a torn last line so the next append starts clean."""
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with self.path.open("r+b") as handle:
                handle.truncate(end)
        records: dict[str, dict[str, Any]] = {}
        for number, line in enumerate(data[:end].splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                records.setdefault(str(record["id"]), record)
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(
                    f"{self.path}:{number}: not a response record; move the file aside to regenerate"
                ) from None
        return records

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


class RequestFailed(RuntimeError):
    pass


def _request_body(prompt: PromptRecord, endpoint: Endpoint, settings: GenerationSettings) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": endpoint.model,
        "messages": prompt.messages,
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
    }
    tools = prompt.tool_schemas()
    if tools:
        body["tools"] = tools
    return body


def _parse_completion(payload: Any) -> tuple[str, str, int, int]:
    try:
        choice = payload["choices"][0]
        message = choice["message"]
        text = message.get("content") or ""
        if not text and message.get("tool_calls"):
            text = json.dumps(message["tool_calls"], ensure_ascii=False)
        usage = payload.get("usage") or {}
        return text, str(choice.get("finish_reason") or ""), int(usage.get("prompt_tokens") or 0), int(
            usage.get("completion_tokens") or 0
        )
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise RequestFailed("response is not an OpenAI chat completion (no choices[0].message)") from None


async def _complete(
    client: httpx.AsyncClient, prompt: PromptRecord, endpoint: Endpoint, settings: GenerationSettings
) -> dict[str, Any]:
    started = time.monotonic()
    try:
        reply = await client.post(endpoint.chat_url, json=_request_body(prompt, endpoint, settings), headers=endpoint.headers())
    except httpx.TimeoutException:
        raise RequestFailed(f"timed out after {settings.request_timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise RequestFailed(f"{exc.__class__.__name__} talking to {endpoint.base_url}") from None
    if reply.status_code != 200:
        raise RequestFailed(f"HTTP {reply.status_code} from {endpoint.base_url}")
    try:
        payload = reply.json()
    except ValueError:
        raise RequestFailed("response body is not JSON") from None
    text, finish_reason, prompt_tokens, completion_tokens = _parse_completion(payload)
    return {
        "id": prompt.id,
        "dataset": prompt.dataset,
        "response": text,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "latency_s": round(time.monotonic() - started, 4),
        "model": str(payload.get("model") or endpoint.model),
        "endpoint": endpoint.base_url,
        "finished_at": time.time(),
    }


async def generate_async(
    prompts: Sequence[PromptRecord],
    resolve_endpoint: Callable[[], Endpoint],
    settings: GenerationSettings,
    checkpoint: ResponseCheckpoint,
    errors_path: Path,
    on_progress: Callable[[Progress], None] | None = None,
    progress_every_s: float = 5.0,
) -> GenerationSummary:
    """Answer every prompt not yet in the checkpoint, appending each answer as it finishes.

    `resolve_endpoint` is called only if there is work left, so a finished dataset never starts
    or contacts a server.
    """
    done = checkpoint.load()
    todo = [p for p in prompts if p.id not in done]
    summary = GenerationSummary(total=len(prompts), already_done=len(prompts) - len(todo))
    if not todo:
        return summary
    endpoint = resolve_endpoint()
    started = time.monotonic()
    last_report = started
    limit = asyncio.Semaphore(settings.concurrency)
    timeout = httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s)
    limits = httpx.Limits(max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency)

    def report(force: bool = False) -> None:
        nonlocal last_report
        now = time.monotonic()
        if on_progress and (force or now - last_report >= progress_every_s):
            last_report = now
            on_progress(
                Progress(summary.already_done + summary.generated, summary.total, summary.completion_tokens, summary.failed, now - started)
            )

    async def one(client: httpx.AsyncClient, prompt: PromptRecord) -> None:
        async with limit:
            try:
                record = await _complete(client, prompt, endpoint, settings)
            except RequestFailed as exc:
                summary.failed += 1
                if len(summary.error_examples) < ERROR_EXAMPLES:
                    summary.error_examples.append(f"{prompt.id}: {exc}")
                ResponseCheckpoint(errors_path).append({"id": prompt.id, "reason": str(exc), "at": time.time()})
                return
            checkpoint.append(record)
            summary.generated += 1
            summary.completion_tokens += record["completion_tokens"]
            report()

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(one(client, p) for p in todo))
    summary.elapsed_s = time.monotonic() - started
    report(force=True)
    return summary


def generate(
    prompts: Sequence[PromptRecord],
    resolve_endpoint: Callable[[], Endpoint],
    settings: GenerationSettings,
    checkpoint: ResponseCheckpoint,
    errors_path: Path,
    on_progress: Callable[[Progress], None] | None = None,
) -> GenerationSummary:
    return asyncio.run(generate_async(prompts, resolve_endpoint, settings, checkpoint, errors_path, on_progress))


def response_rows(prompts: Sequence[PromptRecord], done: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The responses table: one row per answered prompt, in prompt order; ``messages`` is the
    prompt conversation followed by the generated assistant turn."""
    rows = []
    for prompt in prompts:
        record = done.get(prompt.id)
        if record is None:
            continue
        rows.append(
            {
                **{k: record.get(k) for k in ("response", "finish_reason", "prompt_tokens", "completion_tokens", "latency_s", "model", "endpoint", "finished_at")},
                "id": prompt.id,
                "dataset": prompt.dataset,
                "messages": [*prompt.messages, {"role": "assistant", "content": record.get("response") or ""}],
                "tools": prompt.tools,
            }
        )
    return rows
