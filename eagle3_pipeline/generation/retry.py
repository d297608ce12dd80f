"""Which failures are worth another attempt, and how long to wait before it."""

from __future__ import annotations

import random
import time
from email.utils import parsedate_to_datetime

from eagle3_pipeline.config import RetryConfig

RETRYABLE_STATUSES = frozenset({408, 429})


def is_retryable_status(status: int) -> bool:
    """408, 429 and 5xx are transient; every other status (400, 401, 403, 404, …) is not."""
    return status in RETRYABLE_STATUSES or 500 <= status <= 599


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """`Retry-After` as seconds to wait: delta-seconds or an HTTP date; None if absent or unreadable."""
    if not value:
        return None
    text = value.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        moment = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    return max(0.0, moment.timestamp() - (time.time() if now is None else now))


def backoff_s(attempt: int, policy: RetryConfig, retry_after_s: float | None, rng: random.Random) -> float:
    """Wait before attempt ``attempt + 1``: exponential from ``backoff_initial_s``, jittered into
    its upper half, never below the server's ``Retry-After``, and never above ``backoff_max_s``."""
    ceiling = min(policy.backoff_max_s, policy.backoff_initial_s * 2.0 ** (attempt - 1))
    delay = ceiling * rng.uniform(0.5, 1.0)
    if retry_after_s is not None:
        delay = max(delay, retry_after_s)
    return min(delay, policy.backoff_max_s)
