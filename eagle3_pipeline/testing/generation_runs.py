"""Generation as the tests run it against a loopback server: small fast settings, numbered prompts, one
call that generates into a folder, and the JSONL lines a run wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import GenerationConfig
from eagle3_pipeline.generation import Endpoint, GenerationSummary, ResponseCheckpoint, generate
from eagle3_pipeline.records import PromptRecord, content_id
from eagle3_pipeline.testing.fake_openai import FakeOpenAI


def settings(**overrides: Any) -> GenerationConfig:
    """Small, fast settings: short timeouts and backoff, no fsync, progress every 50 ms."""
    base: dict[str, Any] = {
        "max_tokens": 8,
        "concurrency": {"short": 4, "long": 2},
        "connect_timeout_s": 2,
        "read_timeout_s": 5,
        "retry": {"max_attempts": 4, "backoff_initial_s": 0.01, "backoff_max_s": 0.05},
        "fsync": "never",
        "progress_interval_s": 0.05,
    }
    return GenerationConfig.model_validate({**base, **overrides})


def make_prompts(
    n: int, dataset: str = "B1", length_class: str = "short", prefix: str = "question"
) -> list[PromptRecord]:
    prompts = []
    for i in range(n):
        messages = [{"role": "user", "content": f"{prefix} {i}"}]
        prompts.append(PromptRecord(content_id(messages, None), dataset, messages, None, length_class, 5, i))  # type: ignore[arg-type]
    return prompts


def run(
    tmp_path: Path,
    prompts: list[PromptRecord],
    endpoints: list[Endpoint] | FakeOpenAI,
    config: GenerationConfig | None = None,
    **kwargs: Any,
) -> GenerationSummary:
    if isinstance(endpoints, FakeOpenAI):
        endpoints = [Endpoint(endpoints.base_url, "m")]
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl", fsync="never")
    return generate(
        prompts,
        lambda: endpoints,
        settings=config or settings(),
        checkpoint=checkpoint,
        errors_path=tmp_path / "err.jsonl",
        **kwargs,
    )


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
