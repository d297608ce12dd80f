"""One dataset's responses phase end to end: generate what is missing, then write the table."""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle3_pipeline.config import DatasetConfig, GenerationConfig, InferenceConfig, TargetConfig
from eagle3_pipeline.generation.budget import BudgetState, budget_state, counted_tokens
from eagle3_pipeline.generation.capabilities import CapabilityMissing, CapabilityReport, ServerNeeds, probe_capabilities
from eagle3_pipeline.generation.checkpoint import ResponseCheckpoint
from eagle3_pipeline.generation.conversation import RESPONSE_TABLE_SCHEMA, response_rows
from eagle3_pipeline.generation.endpoints import Endpoint
from eagle3_pipeline.generation.failover import FailoverSettings
from eagle3_pipeline.generation.fingerprint import (
    DIGEST_CHARS,
    GenerationFingerprint,
    actual_digest,
    configured_endpoints,
    configured_fingerprint,
    read_fingerprint,
    settle_fingerprint,
)
from eagle3_pipeline.generation.length import LengthCheck, check_lengths
from eagle3_pipeline.generation.outcome import GenerationFailed, GenerationSummary
from eagle3_pipeline.generation.progress import ProgressSink
from eagle3_pipeline.generation.recovery import ServerRecovery
from eagle3_pipeline.generation.runner import generate
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.records import PromptRecord, atomic_path, write_parquet
from eagle3_pipeline.results import ResponsesResult

LISTED_IDS = 50


@dataclass(frozen=True)
class DatasetResult:
    summary: GenerationSummary
    rows: list[dict[str, Any]]
    budget: BudgetState
    fingerprint: GenerationFingerprint
    data_version: str
    lengths: LengthCheck
    held_back: list[str]
    kept_aside: Path | None
    host: str | None = None
    capabilities: CapabilityReport | None = None  # None: nothing was sent, so no server was probed

    @property
    def result(self) -> ResponsesResult:
        """The phase's typed result: what the asset records and the CLI's summary reads."""
        return ResponsesResult.from_metadata(self.as_metadata())

    def as_metadata(self) -> dict[str, Any]:
        rows = self.rows
        finish = Counter(r["finish_reason"] for r in rows)
        latencies = [r["latency_s"] for r in rows if r["latency_s"] is not None]
        costs = [r["cost"] for r in rows if r["cost"] is not None]
        over = [p.id for p in self.lengths.over_length]
        return {
            **self.summary.as_metadata(),
            **self.budget.as_metadata(),
            "rows": len(rows),
            "completion_tokens": sum(r["completion_tokens"] for r in rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "truncated": finish.get("length", 0),
            "truncation_rate": round(finish.get("length", 0) / len(rows), 4) if rows else 0.0,
            "finish_reasons": dict(finish),
            "latency_p50_s": round(percentile(latencies, 50), 3),
            "latency_p90_s": round(percentile(latencies, 90), 3),
            "latency_p99_s": round(percentile(latencies, 99), 3),
            "cost_total": round(sum(costs), 6),
            "rows_without_cost": len(rows) - len(costs),
            "models": sorted({str(r["model"]) for r in rows}),
            "fingerprint": self.fingerprint.fields(),
            "fingerprint_digest": self.fingerprint.digest,
            "data_version": self.data_version,
            "previous_answers_kept_in": str(self.kept_aside) if self.kept_aside else "none",
            "skipped_over_length": len(over),
            "over_length_ids": over[:LISTED_IDS]
            + ([f"... {len(over) - LISTED_IDS} more"] if len(over) > LISTED_IDS else []),
            "length_estimator": self.lengths.estimator,
            "length_estimate_fallbacks": self.lengths.fallbacks,
            "longest_prompt_tokens_est": self.lengths.longest,
            "held_back_by_budget": len(self.held_back),
            "server_capabilities": self.capabilities.as_metadata() if self.capabilities is not None else "not probed",
            **({"host": self.host} if self.host is not None else {}),
        }


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1])


def generate_dataset(
    dataset: DatasetConfig,
    settings: GenerationConfig,
    *,
    target: TargetConfig,
    inference: InferenceConfig,
    layout: ArtifactLayout,
    prompts: Sequence[PromptRecord],
    resolve_endpoints: Callable[[], Sequence[Endpoint]],
    sinks: Sequence[ProgressSink] = (),
    tokenizer_name: str | None = None,
    host: str | None = None,
    tokenize_check: bool = False,
    recovery: ServerRecovery | None = None,
) -> DatasetResult:
    """Answer the prompts still missing from the dataset's checkpoint (within its token budget),
    then write the responses table from the checkpoint; ``host`` names the inference host that
    answered (reported in the result).

    Before anything is sent: the checkpoint's generation fingerprint must be the configured one
    (else :class:`FingerprintMismatch`, or the old answers are kept aside under ``new_version``),
    and prompts that cannot fit ``target.max_seq_len`` with ``max_tokens`` are left out and listed.
    Once the endpoints are resolved (only when there is something to send), each is probed for what
    the dataset needs (:mod:`.capabilities`: tools, reasoning, context length, and ``/tokenize`` when
    ``tokenize_check`` says training_data will ask it); a missing one raises :class:`CapabilityMissing`
    before any request of the partition goes out.
    With ``generation.failover`` the dataset is generated on one backend at a time, moving on by
    deadline or sickness (decisions in ``responses/<dataset>.failover.jsonl``). ``recovery`` brings a
    dead or hung server back mid-run (:mod:`.recovery`; restarts in the summary's metadata).
    Raises :class:`GenerationFailed` if the run was stopped, or if more prompts failed than
    ``max_failed_fraction`` allows; the table is then left as it was."""
    checkpoint = ResponseCheckpoint(layout.checkpoint(dataset.id), settings.fsync, settings.fsync_interval_s)
    decision = settle_fingerprint(
        layout,
        configured_fingerprint(settings, target, inference),
        configured_endpoints(inference),
        settings.on_fingerprint_change,
        dataset.id,
        has_answers=bool(checkpoint.load()),
    )
    lengths = _check_lengths(prompts, settings, target, tokenizer_name)
    failover = FailoverSettings.from_config(settings, inference, dataset.id, layout.failover(dataset.id))
    needs = ServerNeeds(
        tools=next((tools for p in lengths.fits if (tools := p.tool_schemas())), None),
        reasoning=settings.reasoning == "keep",
        context_tokens=lengths.longest_fitting + settings.max_tokens if lengths.fits else None,
        estimator=lengths.estimator,
        tokenize=tokenize_check,
        chat_template_kwargs=settings.chat_template_kwargs,
    )
    probed: list[CapabilityReport] = []

    def resolve_and_probe() -> Sequence[Endpoint]:
        endpoints = resolve_endpoints()
        report = probe_capabilities(endpoints, needs)
        probed.append(report)
        if report.missing:
            raise CapabilityMissing(dataset.id, report)
        return endpoints

    summary = generate(
        lengths.fits,
        resolve_and_probe,
        settings=settings,
        checkpoint=checkpoint,
        errors_path=layout.errors(dataset.id),
        token_budget=dataset.token_budget,
        sinks=sinks,
        failover=failover,
        recovery=recovery,
    )
    _refuse_too_many_failed(dataset.id, summary, len(lengths.fits), settings.max_failed_fraction, layout)
    rows, held_back = _write_table(dataset, settings, layout, lengths, checkpoint)
    stored = read_fingerprint(layout.fingerprint(dataset.id))
    version = data_version(stored["fingerprint"] if stored else decision.fingerprint.fields(), rows)
    state = budget_state(rows, dataset.token_budget, settings)
    return DatasetResult(
        summary,
        rows,
        state,
        decision.fingerprint,
        version,
        lengths,
        held_back,
        decision.kept_aside,
        host,
        probed[0] if probed else None,
    )


def _check_lengths(
    prompts: Sequence[PromptRecord], settings: GenerationConfig, target: TargetConfig, tokenizer_name: str | None
) -> LengthCheck:
    return check_lengths(
        prompts,
        target.max_seq_len,
        max_tokens=settings.max_tokens,
        estimator=settings.length_estimator,
        tokenizer_name=tokenizer_name,
        trust_remote_code=target.trust_remote_code,
        chat_template_kwargs=settings.chat_template_kwargs,
    )


def _refuse_too_many_failed(
    dataset_id: str, summary: GenerationSummary, sent: int, max_failed_fraction: float, layout: ArtifactLayout
) -> None:
    allowed = int(max_failed_fraction * sent)
    failed = summary.failed + summary.quarantined_earlier  # a prompt quarantined earlier is not sent again
    if failed > allowed:
        raise GenerationFailed(
            f"{dataset_id}: {failed} of {sent} requests failed (allowed: {allowed}; quarantined: "
            f"{summary.quarantined + summary.quarantined_earlier}); the finished "
            f"answers are checkpointed and a rerun retries only the rest. "
            f"First errors: {'; '.join(summary.error_examples)}. "
            f"All of them: {layout.errors(dataset_id)}",
            summary,
        )


def _write_table(
    dataset: DatasetConfig,
    settings: GenerationConfig,
    layout: ArtifactLayout,
    lengths: LengthCheck,
    checkpoint: ResponseCheckpoint,
) -> tuple[list[dict[str, Any]], list[str]]:
    """The responses table (and its accounting) from the checkpoint: the rows and the ids held back."""
    rows, held_back = within_budget(response_rows(lengths.fits, checkpoint.load()), dataset.token_budget, settings)
    write_parquet(rows, RESPONSE_TABLE_SCHEMA, layout.responses(dataset.id))
    write_accounting(layout.accounting(dataset.id), lengths, held_back)
    return rows, held_back


def within_budget(
    rows: list[dict[str, Any]], budget: int | None, settings: GenerationConfig
) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows, unless they exceed the budget by more than the requests in flight can explain
    (the budget was lowered after generating): then the answers in id order until the budget is
    reached — an unbiased sample again — and the ids held back (their answers stay checkpointed)."""
    state = budget_state(rows, budget, settings)
    if budget is None or state.within_bound:
        return rows, []
    kept: set[str] = set()
    counted = 0
    for row in sorted(rows, key=lambda r: r["id"]):
        if counted >= budget:
            break
        kept.add(row["id"])
        counted += counted_tokens(row, settings.budget_counts)
    return [r for r in rows if r["id"] in kept], sorted(r["id"] for r in rows if r["id"] not in kept)


def write_accounting(path: Path, lengths: LengthCheck, held_back: Sequence[str]) -> None:
    document = {
        "length_estimator": lengths.estimator,
        "max_seq_len": lengths.max_seq_len,
        "max_tokens": lengths.max_tokens,
        "over_length": sorted(p.id for p in lengths.over_length),
        "held_back_by_budget": list(held_back),
    }
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(document, indent=1))


def read_accounting(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return document if isinstance(document, dict) else {}


def data_version(fingerprint: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """``<actual fingerprint digest>.<digest of the answered ids>``: it changes when the answers were
    made under other settings or by another model, and when answers are added or removed."""
    ids = hashlib.sha256("\n".join(sorted(r["id"] for r in rows)).encode()).hexdigest()[:DIGEST_CHARS]
    return f"{actual_digest(fingerprint, (str(r['model']) for r in rows))}.{ids}"


def table_budget_state(path: Path, budget: int | None, settings: GenerationConfig) -> BudgetState:
    """The budget as a written responses table stands (what the budget asset check verifies)."""
    table = pq.read_table(path)
    columns = [c for c in ("prompt_tokens", "completion_tokens", "turns") if c in table.column_names]
    return budget_state(table.select(columns).to_pylist(), budget, settings)
