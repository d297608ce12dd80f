"""The online benchmark: the target served without a drafter and with each speculative configuration, output
tokens/s at each concurrency, τ as the server reports it, and the configuration to serve.

For the baseline, then each configuration of the sweep (:mod:`~eagle3_pipeline.drafter.serve.sweep`: ``steps``
as a chain first, then ``sweep_*`` within ``max_server_starts``), on the GPU host (the hosts layer: SSH or local):
1. the health gate on the host alone (GPUs, disk, memory) — nothing starts on a sick box;
2. the server starts (:mod:`~eagle3_pipeline.drafter.serve.servers`: ``launch_command`` in its own session, or
   the managed server's launch line), once per arm;
3. once it answers a 1-token request, the full gate on it (process, port, generation, ...); what its
   ``server_process`` check matched (pid and command line) is kept in the arm's result;
4. the prompts (:func:`eval_prompts`) go out at each of ``concurrencies`` in turn, greedy, ``max_tokens`` each,
   streamed (:mod:`~eagle3_pipeline.drafter.serve.client`: per request its tokens as the engine counts them,
   ids, text, time to first token and inter-token latency); τ and per-position acceptance from the engine's
   counters over all of the arm's requests; a request with no verify step is counted, not fatal;
5. the server is stopped.
Speedup at a concurrency: a configuration's output tokens/s over the baseline's, with a paired-bootstrap
interval; the best configuration per concurrency by tokens/s, and the one chosen at ``serve_concurrency``
(none when none beats the baseline): :mod:`~eagle3_pipeline.drafter.serve.report`.

With a managed server on the benchmark's host (``serving.managed``) step 2 is its supervisor's: each arm is the
managed server started from its own launch lines (``ServerPurpose.benchmark``), ready on its health tick, and
replaced by the next; a running server whose line differs from an arm's only by the chat parsers (the
generation server, for the baseline arm) is kept, not reloaded. The served drafter's τ is measured the same way
(:func:`~eagle3_pipeline.drafter.serve.client.measure`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.config import DrafterBenchmarkConfig, PipelineConfig
from eagle3_pipeline.drafter.serve.client import Acceptance, BenchmarkError, Client, Measured, acceptance_of, measure
from eagle3_pipeline.drafter.serve.prompt_sets import BenchPrompt
from eagle3_pipeline.drafter.serve.report import ArmResult, BenchmarkResult
from eagle3_pipeline.drafter.serve.servers import ArmServers, CommandServers, arm_name
from eagle3_pipeline.drafter.serve.set_tau import PromptSetRun, SetSettings, measure_sets
from eagle3_pipeline.drafter.serve.sweep import SpeculativeConfig, configurations
from eagle3_pipeline.drafter.spec import drafter_paths
from eagle3_pipeline.health import HealthReport, HealthThresholds, ServerSpec, run_health_tick, server_root
from eagle3_pipeline.health.gate import UnhealthyError
from eagle3_pipeline.hosts import Host
from eagle3_pipeline.managed import ServerSetup
from eagle3_pipeline.managed.phases import gpu_phase_server

Gate = Callable[[ServerSpec | None], HealthReport]


def make_gate(host: Host, thresholds: HealthThresholds) -> Gate:
    """One health tick on ``host`` (and the server, when given); :class:`UnhealthyError` unless healthy."""

    def gate(spec: ServerSpec | None) -> HealthReport:
        # Before a server starts, its generation is probed by the readiness poll and the tick after it.
        deferred = None if spec is not None else "the benchmark server, once it is started"
        report, _ = run_health_tick(host, spec, thresholds, deferred=deferred)
        if not report.healthy:
            raise UnhealthyError(report)
        return report

    return gate


def benchmark_settings(config: PipelineConfig) -> tuple[DrafterBenchmarkConfig, ServerSetup | None]:
    """``drafter_benchmark`` with its paths filled in — the drafter's export under the artifacts root where
    it is trained, the target the managed server serves, the private folder of the servers' logs — and the
    managed server on the benchmark's host (None: the arms come from ``launch_command``). With a managed server
    the arms are its launch lines, so the settings that would start another server are refused
    (:class:`BenchmarkError` naming them)."""
    settings = config.drafter_benchmark
    assert settings is not None
    where = f"{config.source_file}: drafter_benchmark"
    root = config.compute.artifacts_root if config.compute.kind != "local" else None
    drafter = settings.draft_model_path or str(
        drafter_paths(Path(root) if root else config.artifacts_root)["export_dir"]
    )
    setup = gpu_phase_server(config, "drafter_benchmark")
    if setup is None:
        if settings.target_model_path is None:
            raise BenchmarkError(
                f"{where}.target_model_path: required, since no managed server runs on the benchmark's host "
                "(health.host)"
            )
        log_dir = settings.log_dir or config.health.host.state_dir(str(config.artifacts_root), "benchmark")
        return settings.model_copy(update={"draft_model_path": drafter, "log_dir": log_dir}), None
    problems = [f"{name} is set" for name in ("launch_command", "speculative_args") if getattr(settings, name)]
    if settings.server != setup.engine:
        problems.append(f"server is {settings.server}, the managed server's engine is {setup.engine}")
    if settings.target_model_path not in (None, setup.serving.model):
        problems.append(
            f"target_model_path is {settings.target_model_path}, the managed server's model {setup.serving.model}"
        )
    if problems:
        raise BenchmarkError(
            f"{where}: {'; '.join(problems)}; the arms run on the managed server ({setup.setting}) with its own "
            "launch lines: leave launch_command, speculative_args and target_model_path out, and set server to its "
            "engine"
        )
    update = {
        "draft_model_path": drafter,
        "target_model_path": setup.serving.model,
        "port": setup.port,
        "tp_size": setup.serving.tp_size,
        "base_url": server_root(setup.base_url),
    }
    return settings.model_copy(update=update), setup


def eval_prompts(training_data: Path, count: int) -> list[list[int]]:
    """The first ``count`` eval rows' prompts: ``input_ids`` up to their first generated token."""
    shards = sorted(training_data.glob("eval-*.parquet"))
    if not shards:
        raise BenchmarkError(f"{training_data}: no eval-*.parquet shard; materialize training_data first")
    prompts: list[list[int]] = []
    for shard in shards:
        for row in pq.read_table(shard, columns=["input_ids", "loss_mask"]).to_pylist():
            mask = row["loss_mask"]
            if 1 in mask and mask.index(1) > 0:
                prompts.append(row["input_ids"][: mask.index(1)])
            if len(prompts) == count:
                return prompts
    if not prompts:
        raise BenchmarkError(f"{training_data}: no eval row has a generated response")
    return prompts


def matched_process(report: HealthReport) -> str:
    """``pid N: <command line>`` of the server the gate's ``server_process`` check found."""
    check = next((c for c in report.checks if c.name == "server_process"), None)
    if check is None:
        return "nothing (no server_process check in the report)"
    command = check.data.get("command")
    return f"{check.detail}: {command}" if command else check.detail


def measure_arm(
    settings: DrafterBenchmarkConfig,
    base_url: str,
    *,
    prompts: Sequence[Sequence[int]],
    speculative: bool,
    api_key: str | None,
    report: Reporter,
    name: str,
) -> tuple[list[Measured], Acceptance | None]:
    """The prompts at each concurrency on the running server, and τ over all of them when it speculates."""
    client = Client(settings.server, base_url, settings.request_timeout_s, api_key)
    try:
        before = client.spec_counters() if speculative and settings.server == "vllm" else None
        levels = []
        for concurrency in settings.concurrencies:
            level = measure(
                settings.server,
                base_url,
                prompts=prompts,
                max_tokens=settings.max_tokens,
                concurrency=concurrency,
                timeout_s=settings.request_timeout_s,
                speculative=False,
                api_key=api_key,
            )
            report.progress({"arm": name, "concurrency": concurrency, "tokens_per_s": round(level.tokens_per_s, 2)})
            levels.append(level)
        records = [r for level in levels for r in level.records]
        acceptance = acceptance_of(settings.server, client, records, before) if speculative else None
    finally:
        client.close()
    return levels, acceptance


def run_arm(
    config: SpeculativeConfig | None,
    settings: DrafterBenchmarkConfig,
    *,
    servers: ArmServers,
    base_url: str,
    prompts: Sequence[Sequence[int]],
    gate: Gate,
    report: Reporter,
    sets: PromptSetRun | None = None,
) -> ArmResult:
    """One server start: the baseline (``config`` None) or one configuration, measured at every concurrency;
    with ``sets``, the prompt sets on the same server after the timed requests (not part of its tokens/s)."""
    name = arm_name(config)
    gate(None)
    figures = None
    try:
        spec = servers.start(config)
        process = matched_process(gate(spec))
        report.log(f"{name}: the health gate's server_process check matched {process}")
        levels, acceptance = measure_arm(
            settings,
            base_url,
            prompts=prompts,
            speculative=config is not None,
            api_key=spec.api_key,
            report=report,
            name=name,
        )
        if sets is not None and config is not None:
            figures = _measure_sets(settings, base_url, spec.api_key, sets, report, name)
    finally:
        servers.stop()
    if acceptance is not None and acceptance.no_verify_requests:
        report.log(
            f"{name}: {acceptance.no_verify_requests} of {sum(m.requests for m in levels)} request(s) had no verify "
            "step (an end of sequence straight after the prompt); τ is over the others"
        )
    if acceptance is not None:
        report.log(f"{name}: τ from the server's counters {acceptance.tau:.4f}")
    return ArmResult(name, config, levels, acceptance, process, figures)


def measure_prompt_sets(
    server: str,
    base_url: str,
    *,
    prompts: Sequence[BenchPrompt],
    tokenizer: Any,
    settings: SetSettings,
    timeout_s: float,
    api_key: str | None = None,
) -> dict[str, Any]:
    """τ per prompt set and category on a running speculative server, loop-flagged requests apart, and the
    thinking/answer split (:mod:`eagle3_pipeline.drafter.serve.set_tau`), as JSON-ready figures."""
    client = Client(server, base_url, timeout_s, api_key)
    try:
        figures = measure_sets(client, prompts, tokenizer, settings)
    finally:
        client.close()
    return {**figures, "categories": [asdict(c) for c in figures["categories"]]}


def _measure_sets(
    settings: DrafterBenchmarkConfig,
    base_url: str,
    api_key: str | None,
    sets: PromptSetRun,
    report: Reporter,
    name: str,
) -> dict[str, Any]:
    report.log(f"{name}: τ per prompt set and category over {len(sets.prompts)} prompt(s)")
    figures = measure_prompt_sets(
        settings.server,
        base_url,
        prompts=sets.prompts,
        tokenizer=sets.tokenizer,
        settings=sets.settings,
        timeout_s=settings.request_timeout_s,
        api_key=api_key,
    )
    for flag in figures["loop_flagged"]:
        report.log(f"{name}: a degenerate loop, left out of τ: {flag}")
    return figures


def run_benchmark(
    settings: DrafterBenchmarkConfig,
    host: Host,
    *,
    base_url: str,
    prompts: Sequence[Sequence[int]],
    gate: Gate,
    report: Reporter,
    servers: ArmServers | None = None,
    sets: PromptSetRun | None = None,
) -> BenchmarkResult:
    """The baseline, then each configuration within the budget, one after the other on the same host and
    prompts (see the module doc); ``servers``: where each arm's server comes from (default: ``launch_command``
    on ``host``); ``sets``: the prompt sets, measured per category on the first configuration's server (the
    chain at ``steps``) after its timed requests."""
    servers = servers or CommandServers(settings, host, base_url, report)
    measured, not_run = configurations(settings)
    if not_run:
        report.log(
            f"drafter_benchmark: max_server_starts {settings.max_server_starts} leaves out "
            f"{', '.join(c.label for c in not_run)}"
        )
    baseline = run_arm(None, settings, servers=servers, base_url=base_url, prompts=prompts, gate=gate, report=report)
    arms = [
        run_arm(
            config,
            settings,
            servers=servers,
            base_url=base_url,
            prompts=prompts,
            gate=gate,
            report=report,
            sets=sets if i == 0 else None,
        )
        for i, config in enumerate(measured)
    ]
    result = BenchmarkResult(settings.server, baseline, arms, not_run, settings.chosen_concurrency)
    report.log(f"drafter_benchmark: {result.choice.reason}")
    return result
