"""`throughput`: the server's generated-token counter (Prometheus `/metrics`) must advance.

A frozen generated-token counter while requests are running is a hang, whatever GPU
utilisation says (a wedged NCCL collective keeps GPUs at 100 %). A counter is only comparable
with an earlier scrape, so the caller keeps a `ThroughputBaseline` between ticks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from eagle3_pipeline.health.http import http_client
from eagle3_pipeline.health.report import Status, Verdict
from eagle3_pipeline.health.settings import ServerSpec
from eagle3_pipeline.hosts.tunnel import reach

__all__ = [
    "RUNNING_GAUGES",
    "TOKEN_COUNTERS",
    "MetricsParseError",
    "MetricsScrape",
    "ThroughputBaseline",
    "ThroughputVerdict",
    "evaluate_throughput",
    "fetch_metrics",
    "parse_metrics",
]

# Generated-token counters, most real-time first, with the labels a sample must carry.
TOKEN_COUNTERS: tuple[tuple[str, Mapping[str, str]], ...] = (
    ("sglang:realtime_tokens_total", {"mode": "decode"}),
    ("sglang:generation_tokens_total", {}),
    ("vllm:generation_tokens_total", {}),
)
RUNNING_GAUGES = ("sglang:num_running_reqs", "vllm:num_requests_running")


class MetricsParseError(ValueError):
    """The endpoint did not return Prometheus text."""


@dataclass(frozen=True)
class MetricsScrape:
    """The first known token counter found (summed over its label sets) and running requests."""

    counter: str | None
    tokens: float | None
    running: float | None


@dataclass(frozen=True)
class ThroughputBaseline:
    """The scrape a later tick compares against; JSON-friendly (see `TickState`)."""

    server: str
    counter: str
    tokens: float
    taken_at: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ThroughputBaseline:
        return cls(
            server=str(data["server"]),
            counter=str(data["counter"]),
            tokens=float(data["tokens"]),
            taken_at=float(data["taken_at"]),
        )


@dataclass(frozen=True)
class ThroughputVerdict:
    verdict: Verdict
    baseline: ThroughputBaseline | None


def fetch_metrics(spec: ServerSpec, timeout_s: float) -> MetricsScrape | str:
    """Scrape the server's Prometheus endpoint; a string says why it failed."""
    path = spec.metrics_endpoint
    if path is None:
        return "no metrics endpoint"
    try:
        with http_client(timeout_s, spec.api_key) as client:
            response = client.get(reach(spec.url(path)))
    except httpx.TimeoutException:
        return f"metrics scrape: no answer from {path} within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        return f"metrics scrape of {path} failed: {type(exc).__name__}"
    if response.status_code != 200:
        return f"metrics scrape failed: HTTP {response.status_code} from {path}"
    try:
        return parse_metrics(response.text)
    except MetricsParseError as exc:
        return f"metrics scrape failed: {exc}"


def parse_metrics(text: str) -> MetricsScrape:
    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for name, labels in TOKEN_COUNTERS:
                    if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                        sums[name] = sums.get(name, 0.0) + sample.value
                if sample.name in RUNNING_GAUGES:
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    except ValueError as exc:
        raise MetricsParseError(f"not Prometheus text: {exc}") from None
    counter = next((name for name, _ in TOKEN_COUNTERS if name in sums), None)
    running = next((sums[name] for name in RUNNING_GAUGES if name in sums), None)
    return MetricsScrape(counter=counter, tokens=sums.get(counter) if counter else None, running=running)


def evaluate_throughput(
    scrape: MetricsScrape,
    previous: ThroughputBaseline | None,
    *,
    server: str,
    now: float,
    min_interval_s: float,
) -> ThroughputVerdict:
    """Compare a scrape with the previous baseline; returns the verdict and the next baseline."""
    if scrape.counter is None or scrape.tokens is None:
        names = ", ".join(name for name, _ in TOKEN_COUNTERS)
        return ThroughputVerdict(
            Verdict(Status.UNKNOWN, f"no generated-token counter in /metrics (looked for {names})"), previous
        )
    current = ThroughputBaseline(server=server, counter=scrape.counter, tokens=scrape.tokens, taken_at=now)
    data = {"counter": scrape.counter, "tokens": scrape.tokens, "running": scrape.running}
    comparable = previous is not None and previous.server == server and previous.counter == scrape.counter
    if previous is None or not comparable:
        return ThroughputVerdict(_baseline_verdict(scrape, "first scrape", data), current)
    if scrape.tokens < previous.tokens:
        return ThroughputVerdict(_baseline_verdict(scrape, "counter reset (server restarted?)", data), current)
    return _compare(scrape, previous, current, now - previous.taken_at, min_interval_s, data)


def _compare(
    scrape: MetricsScrape,
    previous: ThroughputBaseline,
    current: ThroughputBaseline,
    elapsed: float,
    min_interval_s: float,
    data: dict[str, Any],
) -> ThroughputVerdict:
    delta = current.tokens - previous.tokens
    data = {**data, "delta_tokens": delta, "elapsed_s": elapsed}
    if delta > 0:
        rate = delta / elapsed if elapsed > 0 else float("inf")
        running = f", {scrape.running:g} requests running" if scrape.running is not None else ""
        return ThroughputVerdict(
            Verdict(Status.OK, f"{rate:.0f} tokens/s over {elapsed:.1f} s{running}", data), current
        )
    if scrape.running is None:
        return ThroughputVerdict(
            Verdict(Status.UNKNOWN, "token counter unchanged and no running-requests gauge in /metrics", data), previous
        )
    if scrape.running == 0:
        return ThroughputVerdict(Verdict(Status.OK, "idle: no running requests", data), current)
    if elapsed < min_interval_s:
        detail = (
            f"token counter unchanged for {elapsed:.0f} s with {scrape.running:g} requests running "
            f"(stalled after {min_interval_s:.0f} s)"
        )
        return ThroughputVerdict(Verdict(Status.WARN, detail, data), previous)
    detail = (
        f"stalled: generated-token counter frozen at {current.tokens:.0f} for {elapsed:.0f} s "
        f"with {scrape.running:g} requests running"
    )
    return ThroughputVerdict(Verdict(Status.CRITICAL, detail, data), previous)


def _baseline_verdict(scrape: MetricsScrape, why: str, data: dict[str, Any]) -> Verdict:
    if scrape.running == 0:
        return Verdict(Status.OK, f"idle: no running requests ({why})", data)
    running = "unknown" if scrape.running is None else f"{scrape.running:g}"
    return Verdict(Status.WARN, f"{why}: {running} requests running; throughput is measured from the next tick", data)
