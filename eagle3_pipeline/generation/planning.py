"""The planner: for each dataset and each backend, how fast, how long and how much it costs to finish.

A backend is one configured endpoint (or the embedded server). Its throughput — completion tokens
per second as the pipeline got them — comes from evidence only: the most recent answers the
checkpoints hold from it (one unbroken stretch of answers, no gap over :data:`GAP_S`), or a short
calibration of real requests (:func:`calibrate`). Without evidence the throughput and the ETA are
unknown, never a guess. The tokens left are the dataset's pending prompts times its mean tokens per
answer, capped by what its token budget still allows; the cost comes from the backend's price table
(no price: unknown, not 0). The best backend is the one that finishes first within ``max_cost``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from eagle3_pipeline.config import DatasetConfig, GenerationConfig, InferenceConfig, PipelineConfig
from eagle3_pipeline.generation.budget import counted_tokens
from eagle3_pipeline.generation.checkpoint import ResponseCheckpoint
from eagle3_pipeline.generation.client import Completion, attempt_completion, request_body
from eagle3_pipeline.generation.conversation import turns_to_regenerate
from eagle3_pipeline.generation.dataset import read_accounting
from eagle3_pipeline.generation.endpoints import Endpoint, Price
from eagle3_pipeline.generation.estimate import UNKNOWN, Workload, cost_of, estimate_left
from eagle3_pipeline.generation.failover import endpoint_label
from eagle3_pipeline.generation.fingerprint import endpoint_identity
from eagle3_pipeline.generation.progress import format_duration
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.records import normalized, read_prompts

EMBEDDED = "embedded"
RECENT_ANSWERS = 500  # the most recent answers of a backend that its throughput is measured on
GAP_S = 120.0  # a longer pause between two answers ends the stretch (an earlier run)
CALIBRATION_PROMPT = "Describe, in a few sentences, how a river shapes the valley it flows through."


@dataclass(frozen=True)
class Backend:
    """Where a dataset could be generated: a name, a base URL without credentials, a model, a price."""

    name: str
    base_url: str
    model: str
    price: Price | None

    def price_text(self) -> str:
        return f"{self.price.prompt_per_mtok:g}/{self.price.completion_per_mtok:g}" if self.price else UNKNOWN


def configured_backends(inference: InferenceConfig, target_model: str) -> list[Backend]:
    """The backends of the `inference` section (an endpoint's model defaults to `target_model`)."""
    if inference.kind == "embedded":
        return [Backend(EMBEDDED, EMBEDDED, target_model, None)]
    return [
        Backend(
            endpoint_label(e),
            endpoint_identity(e.base_url),
            e.model or target_model,
            Price(e.price.prompt_per_mtok, e.price.completion_per_mtok) if e.price else None,
        )
        for e in inference.all_endpoints
    ]


@dataclass(frozen=True)
class Throughput:
    """Completion tokens per second, and what it was measured on."""

    tokens_per_s: float
    answers: int
    seconds: float
    source: str  # "checkpoint" or "calibration"

    def text(self) -> str:
        return f"{self.tokens_per_s:,.1f} ({self.source}: {self.answers} answers in {self.seconds:.1f}s)"


def observed_throughput(records: Iterable[Mapping[str, Any]]) -> Throughput | None:
    """The rate of the latest unbroken stretch of answers: the completion tokens of every answer
    after the first, over the time from the first to the last. None with fewer than two answers."""
    recent = sorted((r for r in records if r.get("finished_at") is not None), key=lambda r: float(r["finished_at"]))[
        -RECENT_ANSWERS:
    ]
    start = len(recent) - 1
    while start > 0 and float(recent[start]["finished_at"]) - float(recent[start - 1]["finished_at"]) <= GAP_S:
        start -= 1
    stretch = recent[start:]
    if len(stretch) < 2:
        return None
    seconds = float(stretch[-1]["finished_at"]) - float(stretch[0]["finished_at"])
    if seconds <= 0:
        return None
    tokens = sum(int(r.get("completion_tokens") or 0) for r in stretch[1:])
    return Throughput(tokens / seconds, len(stretch), seconds, "checkpoint")


def checkpoint_records(layout: ArtifactLayout, dataset_ids: Iterable[str]) -> dict[str, dict[str, dict[str, Any]]]:
    return {d: ResponseCheckpoint(layout.checkpoint(d)).load() for d in dataset_ids}


def throughput_evidence(
    inference: InferenceConfig, target_model: str, records: Mapping[str, Mapping[str, Mapping[str, Any]]]
) -> dict[str, Throughput | None]:
    """Each backend's throughput from the checkpoints' answers (every dataset's), by backend name.
    Answers are matched to a backend by the endpoint they record; the embedded server takes all."""
    backends = configured_backends(inference, target_model)
    by_url: dict[str, list[Mapping[str, Any]]] = {b.base_url: [] for b in backends}
    for dataset in records.values():
        for record in dataset.values():
            url = EMBEDDED if inference.kind == "embedded" else endpoint_identity(str(record.get("endpoint") or ""))
            if url in by_url:
                by_url[url].append(record)
    return {b.name: observed_throughput(by_url[b.base_url]) for b in backends}


def workload(
    layout: ArtifactLayout, settings: GenerationConfig, dataset: DatasetConfig, done: Mapping[str, Mapping[str, Any]]
) -> Workload:
    dataset_id = dataset.id
    budget = dataset.token_budget
    answers = list(done.values())
    counted = sum(counted_tokens(r, settings.budget_counts) for r in answers)
    if not layout.prompts(dataset_id).exists():
        return Workload(dataset_id, None, len(answers), None, None, "prompts not materialized")
    prompts = read_prompts(layout.prompts(dataset_id))
    over_length = set(read_accounting(layout.accounting(dataset_id)).get("over_length") or [])
    todo = [p for p in prompts if p.id not in done and p.id not in over_length]
    return estimate_left(
        dataset_id,
        pending=len(todo),
        answers=len(answers),
        completion_done=sum(int(r.get("completion_tokens") or 0) for r in answers),
        prompt_done=sum(int(r.get("prompt_tokens") or 0) for r in answers),
        budget_left=None if budget is None else budget - counted,
        counts=settings.budget_counts,
        bound_per_prompt=settings.max_tokens
        * (sum(1 + len(turns_to_regenerate(p.messages, settings.regenerate_turns)) for p in todo) / max(1, len(todo))),
        prompt_per_prompt=sum(p.prompt_tokens_est for p in todo) / max(1, len(todo)),
    )


@dataclass(frozen=True)
class PlanRow:
    dataset: str
    backend: Backend
    throughput: Throughput | None
    completion_left: int | None
    eta_s: float | None
    cost: float | None

    def as_dict(self) -> dict[str, Any]:
        t = self.throughput
        return {
            "dataset": self.dataset,
            "backend": self.backend.name,
            "base_url": self.backend.base_url,
            "model": self.backend.model,
            "price_per_mtok": {
                "prompt": self.backend.price.prompt_per_mtok,
                "completion": self.backend.price.completion_per_mtok,
            }
            if self.backend.price
            else UNKNOWN,
            "tokens_per_s": round(t.tokens_per_s, 2) if t else UNKNOWN,
            "throughput_source": f"{t.source}: {t.answers} answers in {t.seconds:.1f}s" if t else "no evidence",
            "completion_tokens_left": self.completion_left if self.completion_left is not None else UNKNOWN,
            "eta_s": round(self.eta_s, 1) if self.eta_s is not None else UNKNOWN,
            "cost_usd": round(self.cost, 6) if self.cost is not None else UNKNOWN,
        }


@dataclass
class Plan:
    max_cost: float | None
    workloads: dict[str, Workload]
    rows: list[PlanRow]
    best: dict[str, str | None] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_cost_usd": self.max_cost,
            "datasets": [
                {
                    "dataset": d,
                    "pending_prompts": w.pending if w.pending is not None else UNKNOWN,
                    "completion_tokens_left": w.completion_left if w.completion_left is not None else UNKNOWN,
                    "tokens_left_basis": w.basis,
                    "best": self.best.get(d),
                    "why": self.why.get(d, ""),
                    "backends": [r.as_dict() for r in self.rows if r.dataset == d],
                }
                for d, w in self.workloads.items()
            ],
        }

    def table(self) -> list[list[str]]:
        header = ["dataset", "backend", "model", "$/Mtok in/out", "tok/s", "tokens left", "ETA", "cost $", "best"]
        lines = [header]
        for r in self.rows:
            lines.append(
                [
                    r.dataset,
                    r.backend.name,
                    r.backend.model,
                    r.backend.price_text(),
                    r.throughput.text() if r.throughput else UNKNOWN,
                    str(r.completion_left) if r.completion_left is not None else UNKNOWN,
                    format_duration(r.eta_s) if r.eta_s is not None else UNKNOWN,
                    f"{r.cost:.4f}" if r.cost is not None else UNKNOWN,
                    "<- best" if self.best.get(r.dataset) == r.backend.name else "",
                ]
            )
        return lines

    def text(self) -> str:
        lines = self.table()
        widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
        out = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in lines]
        ceiling = f"max cost ${self.max_cost:g}" if self.max_cost is not None else "no cost ceiling"
        out += ["", f"best = finishes first within the cost ceiling ({ceiling}); tokens left are completion tokens"]
        out += [
            f"{d}: {self.best[d] or 'none'} — {self.why[d]}; tokens left from {w.basis}"
            for d, w in self.workloads.items()
        ]
        return "\n".join(out)

    def markdown(self, dataset: str | None = None) -> str:
        header, *body = self.table()
        body = [row for row in body if dataset is None or row[0] == dataset]
        cell = lambda text: text.replace("|", "\\|")  # noqa: E731
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in body]
        notes = [d for d in self.workloads if dataset is None or d == dataset]
        lines += [""] + [
            f"{d}: best {self.best[d] or 'none'} — {self.why[d]}; tokens left from {self.workloads[d].basis}"
            for d in notes
        ]
        return "\n".join(lines)


def build_plan(
    config: PipelineConfig,
    throughput: Mapping[str, Throughput | None],
    records: Mapping[str, Mapping[str, Mapping[str, Any]]],
    max_cost: float | None = None,
    datasets: Sequence[str] | None = None,
) -> Plan:
    """The plan for ``datasets`` (default: all) over every configured backend."""
    plan = Plan(max_cost, {}, [])
    layout = ArtifactLayout(config.artifacts_root)
    backends = configured_backends(config.inference, config.target.model)
    for dataset in datasets or config.dataset_ids:
        work = workload(layout, config.generation, config.dataset(dataset), records.get(dataset, {}))
        plan.workloads[dataset] = work
        rows = []
        for backend in backends:
            rate = throughput.get(backend.name)
            left = work.completion_left
            eta = (
                left / rate.tokens_per_s
                if rate and left is not None and rate.tokens_per_s > 0
                else (0.0 if left == 0 else None)
            )
            rows.append(PlanRow(dataset, backend, rate, left, eta, cost_of(backend.price, work.prompt_left, left)))
        plan.rows += rows
        plan.best[dataset], plan.why[dataset] = _best(rows, work, max_cost)
    return plan


def _best(rows: Sequence[PlanRow], work: Workload, max_cost: float | None) -> tuple[str | None, str]:
    if work.completion_left is None:
        return None, "unknown: the prompts are not materialized"
    if work.completion_left == 0:
        return None, "nothing left to generate"
    measured = [r for r in rows if r.eta_s is not None]
    if not measured:
        return None, "unknown: no backend has a measured throughput (run with --calibrate N)"
    within = [r for r in measured if max_cost is None or (r.cost is not None and r.cost <= max_cost)]
    if not within:
        return None, f"no measured backend finishes within ${max_cost:g} (a backend without a price cannot be shown to)"
    best = min(within, key=lambda r: (r.eta_s or 0.0, r.cost if r.cost is not None else math.inf))
    return best.backend.name, f"finishes first ({format_duration(best.eta_s)})"


def dataset_plan(config: PipelineConfig, dataset_id: str) -> Plan:
    """One dataset's plan from the checkpoints' evidence (what each `responses` materialization shows)."""
    records = checkpoint_records(ArtifactLayout(config.artifacts_root), config.dataset_ids)
    return build_plan(
        config, throughput_evidence(config.inference, config.target.model, records), records, datasets=[dataset_id]
    )


def calibration_prompts(layout: ArtifactLayout, dataset_ids: Iterable[str], n: int) -> list[list[dict[str, Any]]]:
    """``n`` conversations to calibrate on: pending prompts of the datasets (in id order, taken in
    turn from each), or a fixed question when no prompts are materialized."""
    per_dataset = []
    for dataset in dataset_ids:
        if layout.prompts(dataset).exists():
            done = ResponseCheckpoint(layout.checkpoint(dataset)).load()
            per_dataset.append(
                sorted((p for p in read_prompts(layout.prompts(dataset)) if p.id not in done), key=lambda p: p.id)
            )
    chosen: list[list[dict[str, Any]]] = []
    for index in range(max((len(p) for p in per_dataset), default=0)):
        chosen += [list(p[index].messages) for p in per_dataset if index < len(p)]
    chosen = chosen[:n]
    return chosen + [[{"role": "user", "content": CALIBRATION_PROMPT}]] * (n - len(chosen))


async def _calibrate_one(
    settings: GenerationConfig, endpoint: Endpoint, prompts: Sequence[list[dict[str, Any]]]
) -> Throughput | str:
    from eagle3_pipeline.generation.runner import _client_factory

    width = min(len(prompts), settings.concurrency.short)
    idle = [_client_factory(settings, 1)() for _ in range(width)]
    slots = asyncio.Semaphore(width)
    failures: list[str] = []

    async def one(messages: list[dict[str, Any]]) -> int:
        async with slots:
            client = idle.pop()
            try:
                body = request_body(
                    endpoint,
                    [normalized(m) for m in messages],
                    None,
                    settings.max_tokens,
                    settings.temperature,
                    settings.chat_template_kwargs,
                )
                outcome = await attempt_completion(client, endpoint, body, 0)
            finally:
                idle.append(client)
        if isinstance(outcome, Completion):
            return outcome.completion_tokens
        failures.append(outcome.reason)
        return 0

    started = time.monotonic()
    try:
        tokens = await asyncio.gather(*(one(m) for m in prompts))
    finally:
        seconds = time.monotonic() - started
        for client in idle:
            await client.aclose()
    answered = len(prompts) - len(failures)
    if not answered or seconds <= 0:
        return f"calibration failed: {failures[0] if failures else 'no answer'}"
    return Throughput(sum(tokens) / seconds, answered, seconds, "calibration")


def calibrate(
    config: PipelineConfig, endpoints: Sequence[Endpoint], n: int
) -> tuple[dict[str, Throughput | None], dict[str, str]]:
    """Send ``n`` real requests to each backend (``endpoints`` in the order of
    :func:`configured_backends`), ``min(n, concurrency.short)`` at a time, with the run's
    ``max_tokens`` and temperature; nothing is written. Returns the throughputs by backend name,
    and the (redacted) reason for each backend whose calibration failed."""
    prompts = calibration_prompts(ArtifactLayout(config.artifacts_root), config.dataset_ids, n)
    measured: dict[str, Throughput | None] = {}
    failed: dict[str, str] = {}
    for backend, endpoint in zip(configured_backends(config.inference, config.target.model), endpoints, strict=True):
        outcome = asyncio.run(_calibrate_one(config.generation, endpoint, prompts))
        if isinstance(outcome, Throughput):
            measured[backend.name] = outcome
        else:
            measured[backend.name] = None
            failed[backend.name] = endpoint.redact(outcome)
    return measured, failed
