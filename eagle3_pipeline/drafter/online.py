"""The online benchmark: the target served without and with the drafter, τ as the server reports it.

For each arm (``baseline``, then ``speculative``) on the GPU host (the hosts layer: SSH or local):
1. the health gate on the host alone (GPUs, disk, memory) — nothing starts on a sick box;
2. the server starts from ``launch_command`` in its own session (``setsid``), logging to ``log_dir``; the
   default lines bind the host's 127.0.0.1, reached from here through the SSH tunnel
   (:mod:`eagle3_pipeline.hosts.tunnel`) that every request of the benchmark goes through (:func:`reach`);
   ``{speculative}`` is empty for the baseline and ``speculative_args`` for the drafter (SGLang
   chain mode: EAGLE3, top-k 1, K steps, K+1 draft tokens; vLLM: ``--speculative-config`` with
   ``method: eagle3`` and K speculative tokens); every value is ``shlex.quote``d;
3. once it answers a 1-token request, the full gate on it (process, port, generation, ...); what its
   ``server_process`` check matched (pid and command line) is kept in the arm's result;
4. N eval prompts (token ids cut from the eval shards at their first generated token, so the target's
   own chat template is already applied) go out at ``concurrency``, greedy, ``max_tokens`` each:
   SGLang's native ``/generate`` (its ``meta_info`` carries ``completion_tokens`` and
   ``spec_verify_ct``: τ = Σ completion_tokens / Σ spec_verify_ct, as SpecForge's benchmarks compute
   it; SGLang leaves ``spec_verify_ct`` out when it is 0 — a request answered without a verify step — so
   such requests are counted apart, reported as ``no_verify_requests``, and left out of τ), vLLM's
   ``/v1/completions`` (τ = 1 + Δ``vllm:spec_decode_num_accepted_tokens`` /
   Δ``vllm:spec_decode_num_drafts`` from ``/metrics`` around the arm, and per draft position ``p``
   Δ``vllm:spec_decode_num_accepted_tokens_per_pos{position="p"}`` / Δdrafts: vLLM's own per-position
   acceptance rate, the share of verify steps that accepted at least ``p + 1`` drafts; vllm
   ``v1/spec_decode/metrics.py``, ``SpecDecodingProm``);
5. the server's process group is stopped (TERM, then KILL).
Tokens/s is completion tokens over the arm's wall time; speedup = speculative / baseline tokens/s.

With a managed server on the benchmark's host (``serving.managed``) steps 2 and 5 are its supervisor's: each
arm is the managed server started from its own launch lines (``ServerPurpose.benchmark``), ready on its health
tick, and replaced by the next (:class:`ManagedServers`); a running server whose line differs from an arm's only
by the chat parsers (the generation server, for the baseline arm) is kept, not reloaded. The served drafter's τ
is measured the same way (:func:`measure`).
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import pyarrow.parquet as pq

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.config import DrafterBenchmarkConfig, PipelineConfig
from eagle3_pipeline.drafter.prompt_sets import BenchPrompt
from eagle3_pipeline.drafter.set_tau import Completion, PromptSetRun, SetSettings, measure_sets, prompt_set_metadata
from eagle3_pipeline.drafter.spec import drafter_paths
from eagle3_pipeline.health import HealthReport, HealthThresholds, ServerSpec, run_health_tick, server_root
from eagle3_pipeline.hosts import Host, quote_args, reach
from eagle3_pipeline.hosts.identity import RECORD_IDENTITY, ProcessIdentity, kill_recorded_group
from eagle3_pipeline.hosts.private import PrivateStateError, ensure_private_dir
from eagle3_pipeline.managed import ManagedServerPlan, Supervisor
from eagle3_pipeline.managed.launch import (
    EagleDrafter,
    EngineSettings,
    ServerPurpose,
    build_launch,
    drafter_args,
    vllm_eagle3_config,
)
from eagle3_pipeline.managed.phases import gpu_phase_server
from eagle3_pipeline.watch.monitor import UnhealthyError

VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
POLL_S = 2.0
STOP_GRACE_S = 30
HOST_COMMAND_TIMEOUT_S = 60.0

Gate = Callable[[ServerSpec | None], HealthReport]


class BenchmarkError(RuntimeError):
    """A server that did not start, died, or reported no speculative statistics."""


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


def benchmark_settings(config: PipelineConfig) -> tuple[DrafterBenchmarkConfig, ManagedServerPlan | None]:
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
    plan = gpu_phase_server(config, "drafter_benchmark")
    if plan is None:
        if settings.target_model_path is None:
            raise BenchmarkError(
                f"{where}.target_model_path: required, since no managed server runs on the benchmark's host "
                "(health.host)"
            )
        log_dir = settings.log_dir or config.health.host.state_dir(str(config.artifacts_root), "benchmark")
        return settings.model_copy(update={"draft_model_path": drafter, "log_dir": log_dir}), None
    problems = [f"{name} is set" for name in ("launch_command", "speculative_args") if getattr(settings, name)]
    if settings.server != plan.engine:
        problems.append(f"server is {settings.server}, the managed server's engine is {plan.engine}")
    if settings.target_model_path not in (None, plan.serving.model):
        problems.append(
            f"target_model_path is {settings.target_model_path}, the managed server's model {plan.serving.model}"
        )
    if problems:
        raise BenchmarkError(
            f"{where}: {'; '.join(problems)}; the arms run on the managed server ({plan.setting}) with its own "
            "launch lines: leave launch_command, speculative_args and target_model_path out, and set server to its "
            "engine"
        )
    update = {
        "draft_model_path": drafter,
        "target_model_path": plan.serving.model,
        "port": plan.port,
        "tp_size": plan.serving.tp_size,
        "base_url": server_root(plan.base_url),
    }
    return settings.model_copy(update=update), plan


def benchmark_path(settings: DrafterBenchmarkConfig, name: str) -> str:
    """``target_model_path``, ``draft_model_path`` or ``log_dir``, which :func:`benchmark_settings` fills in."""
    value = getattr(settings, name)
    if not isinstance(value, str):
        raise BenchmarkError(f"drafter_benchmark.{name}: not set (benchmark_settings fills it in from the pipeline)")
    return value


def launch_command(settings: DrafterBenchmarkConfig, speculative: bool) -> str:
    """The shell command line for one arm, every value quoted: the user's templates when set, else the
    servers' builder (:func:`eagle3_pipeline.managed.launch.build_launch`)."""
    target = benchmark_path(settings, "target_model_path")
    drafter = EagleDrafter(benchmark_path(settings, "draft_model_path"), settings.steps)
    values: dict[str, Any] = {
        "target": shlex.quote(target),
        "drafter": shlex.quote(drafter.path),
        "port": settings.port,
        "tp": settings.tp_size,
        "steps": settings.steps,
        "draft_tokens": settings.steps + 1,
        "speculative_config": shlex.quote(json.dumps(vllm_eagle3_config(drafter))),
    }
    if not speculative:
        extra = ""
    elif settings.speculative_args:
        extra = settings.speculative_args.format(**values)
    else:
        extra = shlex.join(drafter_args(settings.server, drafter))
    if settings.launch_command:
        return settings.launch_command.format(**values, speculative=extra).strip()
    # Loopback: the benchmark reaches a server on an SSH host through a tunnel (eagle3_pipeline.hosts.tunnel).
    server = EngineSettings(settings.server, "python", target, settings.port, "127.0.0.1", settings.tp_size)
    return f"{build_launch(server, ServerPurpose.benchmark(None)).shell()} {extra}".strip()


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
    """τ of an arm as the server reports it, and per draft position where the server says."""

    tau: float
    per_position: list[float] | None  # P(a verify step accepts >= p + 1 drafts), p = 0 … K-1
    verify_steps: int | None = None  # vLLM's drafts (SGLang's spec_verify_ct)
    accepted_tokens: int | None = None
    no_verify_requests: int = 0  # SGLang: requests whose meta_info has no spec_verify_ct (0 verify steps)


def conditional_rates(per_position: Sequence[float]) -> list[float | None]:
    """P(depth j accepted | the depths before it accepted), j = 1 … K, from the per-position rates
    P(accepted >= p + 1): drafter_eval's ``accept_d<j>`` (None where no step reached depth j)."""
    reached = [1.0, *per_position][: len(per_position)]
    return [rate / reach if reach else None for rate, reach in zip(per_position, reached, strict=True)]


@dataclass(frozen=True)
class ArmResult:
    arm: str
    requests: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float
    tau: float | None  # as the server reports it; None for the baseline
    acceptance_per_position: list[float] | None = None  # vLLM only (Acceptance.per_position)
    verify_steps: int | None = None
    accepted_tokens: int | None = None
    server_process: str = ""  # what the health gate's server_process check matched
    no_verify_requests: int = 0  # requests answered with no verify step (Acceptance.no_verify_requests)
    prompt_sets: dict[str, Any] | None = None  # the speculative arm's τ per set and category (measure_prompt_sets)


@dataclass(frozen=True)
class BenchmarkResult:
    server: str
    steps: int
    baseline: ArmResult
    speculative: ArmResult

    @property
    def speedup(self) -> float:
        return self.speculative.tokens_per_s / self.baseline.tokens_per_s if self.baseline.tokens_per_s else 0.0

    def as_metadata(self) -> dict[str, Any]:
        """Flat figures (per position: ``acceptance_pos<p>``, vLLM's per-position acceptance rate, and
        ``accept_d<j>``, the conditional rate under drafter_eval's name), and both arms in full."""
        rates = self.speculative.acceptance_per_position or []
        per_position: dict[str, float] = {f"acceptance_pos{p}": round(rate, 4) for p, rate in enumerate(rates)}
        for depth, rate in enumerate(conditional_rates(rates), start=1):
            if rate is not None:
                per_position[f"accept_d{depth}"] = round(rate, 4)
        return {
            "server": self.server,
            "steps": self.steps,
            "tau_server": round(self.speculative.tau or 0.0, 4),
            **per_position,
            "tokens_per_s_baseline": round(self.baseline.tokens_per_s, 2),
            "tokens_per_s_speculative": round(self.speculative.tokens_per_s, 2),
            "speedup": round(self.speedup, 4),
            "requests": self.speculative.requests,
            "no_verify_requests": self.speculative.no_verify_requests,
            **prompt_set_metadata(self.speculative.prompt_sets),
            "arms": [asdict(self.baseline), asdict(self.speculative)],
        }


class RemoteServer:
    """One server process group on the host, started in its own session, its log in a private folder
    (:mod:`eagle3_pipeline.hosts.private`), and stopped by group only while its leader is the process started
    (pid, start time, boot id: :func:`eagle3_pipeline.hosts.identity.kill_recorded_group`)."""

    def __init__(self, host: Host, command: str, log_path: str) -> None:
        self.host = host
        self.command = command
        self.log_path = log_path
        self.identity: ProcessIdentity | None = None

    @property
    def pid(self) -> int | None:
        return self.identity.pid if self.identity is not None else None

    def start(self) -> None:
        try:
            ensure_private_dir(self.host, str(Path(self.log_path).parent), "drafter_benchmark.log_dir")
        except PrivateStateError as exc:
            raise BenchmarkError(str(exc)) from None
        log = shlex.quote(self.log_path)
        line = (
            f"if [ -L {log} ]; then echo 'the log is a symbolic link: refused' >&2; exit 1; fi; "
            f"setsid sh -c {shlex.quote(self.command)} > {log} 2>&1 < /dev/null & p=$!; {RECORD_IDENTITY}"
        )
        result = self.host.run(line, HOST_COMMAND_TIMEOUT_S)
        identity = ProcessIdentity.parse(result.stdout.strip()) if result.ok else None
        if identity is None:
            raise BenchmarkError(
                f"{self.host.name}: could not start the server ({result.stderr.strip() or result.stdout.strip()})"
            )
        self.identity = identity

    def alive(self) -> bool:
        return (
            self.pid is not None and self.host.run(quote_args("pgrep", "-g", str(self.pid)), HOST_COMMAND_TIMEOUT_S).ok
        )

    def log_tail(self, lines: int = 20) -> str:
        return self.host.run(quote_args("tail", "-n", str(lines), self.log_path), HOST_COMMAND_TIMEOUT_S).stdout

    def stop(self) -> None:
        if self.identity is None:
            return
        # Refused only when its pid is another process's or the host rebooted: the server is gone either way.
        kill_recorded_group(self.host, self.identity, STOP_GRACE_S)
        self.identity = None


class _Client:
    """Greedy requests by token ids, in the server's own protocol (``server``: sglang or vllm)."""

    def __init__(self, server: str, base_url: str, timeout_s: float, api_key: str | None = None) -> None:
        self.server = server
        self.root = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout_s, headers=headers)
        self.model: str | None = None

    def url(self, path: str) -> str:
        """Where a request for ``path`` goes: through this process's tunnel to the server when it has one."""
        return reach(self.root + path)

    def close(self) -> None:
        self.http.close()

    def complete(self, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
        if self.server == "sglang":
            body = {"input_ids": list(prompt), "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0}}
            reply = self.http.post(self.url("/generate"), json=body)
            reply.raise_for_status()
            meta = reply.json()["meta_info"]
            return {"completion_tokens": int(meta["completion_tokens"]), "verify_steps": meta.get("spec_verify_ct")}
        if self.model is None:
            models = self.http.get(self.url("/v1/models"))
            models.raise_for_status()
            self.model = str(models.json()["data"][0]["id"])
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0}
        reply = self.http.post(self.url("/v1/completions"), json=body)
        reply.raise_for_status()
        return {"completion_tokens": int(reply.json()["usage"]["completion_tokens"]), "verify_steps": None}

    def generate(self, prompt: Sequence[int], max_tokens: int) -> Completion:
        """One greedy request with its completion's token ids and text (the prompt sets' requests)."""
        if self.server == "sglang":
            body = {"input_ids": list(prompt), "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0}}
            reply = self.http.post(self.url("/generate"), json=body)
            reply.raise_for_status()
            answer = reply.json()
            steps = answer["meta_info"].get("spec_verify_ct")
            return Completion(tuple(answer["output_ids"]), str(answer["text"]), int(steps) if steps else None)
        if self.model is None:
            models = self.http.get(self.url("/v1/models"))
            models.raise_for_status()
            self.model = str(models.json()["data"][0]["id"])
        body = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        reply = self.http.post(self.url("/v1/completions"), json=body)
        reply.raise_for_status()
        choice = reply.json()["choices"][0]
        return Completion(tuple(choice["token_ids"]), str(choice["text"]), None)

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


def _wait_ready(server: RemoteServer, client: _Client, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive():
            raise BenchmarkError(f"the server exited during start-up; log {server.log_path}:\n{server.log_tail()}")
        try:
            client.complete([1], 1)
            return
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            time.sleep(POLL_S)
    raise BenchmarkError(
        f"the server did not answer within {timeout_s:g} s; log {server.log_path}:\n{server.log_tail()}"
    )


@dataclass(frozen=True)
class Measured:
    """Prompts sent to one server: completion tokens, wall time, and the acceptance when it speculates."""

    requests: int
    completion_tokens: int
    wall_s: float
    acceptance: Acceptance | None

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


def measure(
    server: str,
    base_url: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    timeout_s: float,
    speculative: bool,
    api_key: str | None = None,
) -> Measured:
    """``prompts`` sent greedily to a running server (``server``: sglang or vllm) at ``concurrency``; with
    ``speculative``, τ as the server reports it (module doc, step 4): the served drafter's figure too.
    ``api_key``: the key a managed server requires (``serving.api_key_env``)."""
    client = _Client(server, base_url, timeout_s, api_key)
    try:
        before = client.spec_counters() if speculative and server == "vllm" else None
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            answers = list(pool.map(lambda p: client.complete(p, max_tokens), prompts))
        wall = time.monotonic() - started
        acceptance = _acceptance(server, client, answers, before) if speculative else None
    finally:
        client.close()
    return Measured(len(answers), sum(a["completion_tokens"] for a in answers), round(wall, 3), acceptance)


def measure_prompt_sets(
    server: str,
    base_url: str,
    prompts: Sequence[BenchPrompt],
    tokenizer: Any,
    settings: SetSettings,
    timeout_s: float,
    api_key: str | None = None,
) -> dict[str, Any]:
    """τ per prompt set and category on a running speculative server, loop-flagged requests apart, and the
    thinking/answer split (:mod:`eagle3_pipeline.drafter.set_tau`), as JSON-ready figures."""
    client = _Client(server, base_url, timeout_s, api_key)
    try:
        figures = measure_sets(client, prompts, tokenizer, settings)
    finally:
        client.close()
    return {**figures, "categories": [asdict(c) for c in figures["categories"]]}


class ArmServers(Protocol):
    """How the benchmark gets the server of each arm: :meth:`start` returns once it answers, with what the
    health gate checks on it; :meth:`stop` after the arm."""

    def start(self, arm: str) -> ServerSpec: ...

    def stop(self) -> None: ...


class CommandServers:
    """Each arm's server from ``launch_command`` (:func:`launch_command`), stopped after its arm."""

    def __init__(self, settings: DrafterBenchmarkConfig, host: Host, base_url: str, report: Reporter) -> None:
        self.settings = settings
        self.host = host
        self.base_url = base_url
        self.report = report
        self.server: RemoteServer | None = None

    def start(self, arm: str) -> ServerSpec:
        settings = self.settings
        self.server = RemoteServer(
            self.host,
            launch_command(settings, arm == "speculative"),
            f"{benchmark_path(settings, 'log_dir')}/{arm}.log",
        )
        self.report.log(f"{arm}: starting `{self.server.command}` on {self.host.name}")
        self.server.start()
        client = _Client(settings.server, self.base_url, settings.request_timeout_s)
        try:
            _wait_ready(self.server, client, settings.startup_timeout_s)
        finally:
            client.close()
        return server_spec(settings, self.base_url)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class ManagedServers:
    """Each arm's server from the managed server's launch lines (``ServerPurpose.benchmark``): the supervisor
    replaces the previous arm's server with it, and is left to stop the last one."""

    def __init__(self, supervisor: Supervisor, drafter: EagleDrafter) -> None:
        self.supervisor = supervisor
        self.drafter = drafter

    def start(self, arm: str) -> ServerSpec:
        purpose = ServerPurpose.benchmark(self.drafter if arm == "speculative" else None)
        self.supervisor.ensure(purpose, f"drafter_benchmark: the {arm} arm")
        return self.supervisor.server.plan.server_spec()

    def stop(self) -> None:
        return None


def _run_arm(
    arm: str,
    settings: DrafterBenchmarkConfig,
    servers: ArmServers,
    base_url: str,
    prompts: Sequence[Sequence[int]],
    gate: Gate,
    report: Reporter,
    sets: PromptSetRun | None = None,
) -> ArmResult:
    speculative = arm == "speculative"
    gate(None)
    try:
        spec = servers.start(arm)
        process = matched_process(gate(spec))
        report.log(f"{arm}: the health gate's server_process check matched {process}")
        measured = measure(
            settings.server,
            base_url,
            prompts,
            settings.max_tokens,
            settings.concurrency,
            settings.request_timeout_s,
            speculative,
            spec.api_key,
        )
        acceptance = measured.acceptance
        figures = _measure_sets(settings, base_url, spec.api_key, sets, report) if speculative and sets else None
        result = ArmResult(
            arm,
            measured.requests,
            measured.completion_tokens,
            measured.wall_s,
            measured.tokens_per_s,
            acceptance.tau if acceptance else None,
            acceptance.per_position if acceptance else None,
            acceptance.verify_steps if acceptance else None,
            acceptance.accepted_tokens if acceptance else None,
            process,
            acceptance.no_verify_requests if acceptance else 0,
            figures,
        )
        if result.no_verify_requests:
            report.log(
                f"{arm}: {result.no_verify_requests} of {result.requests} request(s) had no verify step (SGLang "
                "reports no spec_verify_ct for them); τ is over the others"
            )
        report.progress(
            {
                "arm": arm,
                "tokens_per_s": round(result.tokens_per_s, 2),
                **({"tau_server": round(acceptance.tau, 4)} if acceptance else {}),
            }
        )
        return result
    finally:
        servers.stop()


def _measure_sets(
    settings: DrafterBenchmarkConfig, base_url: str, api_key: str | None, sets: PromptSetRun, report: Reporter
) -> dict[str, Any]:
    """The prompt sets on the speculative arm's server, after its timed run (not part of its tokens/s)."""
    report.log(f"speculative: τ per prompt set and category over {len(sets.prompts)} prompt(s)")
    figures = measure_prompt_sets(
        settings.server, base_url, sets.prompts, sets.tokenizer, sets.settings, settings.request_timeout_s, api_key
    )
    for flag in figures["loop_flagged"]:
        report.log(f"speculative: a degenerate loop, left out of τ: {flag}")
    return figures


def matched_process(report: HealthReport) -> str:
    """``pid N: <command line>`` of the server the gate's ``server_process`` check found."""
    check = next((c for c in report.checks if c.name == "server_process"), None)
    if check is None:
        return "nothing (no server_process check in the report)"
    command = check.data.get("command")
    return f"{check.detail}: {command}" if command else check.detail


def _acceptance(
    server: str, client: _Client, answers: Sequence[dict[str, Any]], before: SpecCounters | None
) -> Acceptance:
    if server == "sglang":
        verified = [a for a in answers if a["verify_steps"]]
        if not verified:
            raise BenchmarkError(
                f"SGLang reported no spec_verify_ct in meta_info for any of {len(answers)} request(s): is "
                "speculative decoding on?"
            )
        steps = sum(int(a["verify_steps"]) for a in verified)
        tokens = sum(a["completion_tokens"] for a in verified)
        return Acceptance(tokens / steps, None, steps, no_verify_requests=len(answers) - len(verified))
    assert before is not None
    delta = client.spec_counters().since(before)
    if delta.drafts <= 0:
        raise BenchmarkError(f"vLLM's {VLLM_DRAFTS} did not advance: is speculative decoding on?")
    per_position = [accepted / delta.drafts for accepted in delta.per_position] or None
    return Acceptance(1.0 + delta.accepted / delta.drafts, per_position, int(delta.drafts), int(delta.accepted))


def server_spec(settings: DrafterBenchmarkConfig, base_url: str) -> ServerSpec:
    """What the health gate checks once the server is up. A ``process_pattern`` makes an SGLang server a
    custom one (no per-rank scheduler check); a vLLM server stays ``vllm`` (it has no per-rank check, and
    keeps its ``/metrics`` for the throughput check)."""
    port = settings.port
    custom = settings.process_pattern and settings.server == "sglang"
    return ServerSpec(
        kind="custom" if custom else settings.server,
        port=port,
        base_url=base_url.rstrip("/"),
        model=benchmark_path(settings, "target_model_path"),
        tp_size=settings.tp_size,
        process_pattern=settings.process_pattern,
    )


def run_benchmark(
    settings: DrafterBenchmarkConfig,
    host: Host,
    base_url: str,
    prompts: Sequence[Sequence[int]],
    gate: Gate,
    report: Reporter,
    servers: ArmServers | None = None,
    sets: PromptSetRun | None = None,
) -> BenchmarkResult:
    """Both arms, one after the other on the same host and prompts (see the module doc); ``servers``:
    where each arm's server comes from (default: ``launch_command`` on ``host``); ``sets``: the prompt sets
    measured per category on the speculative arm's server after its timed run."""
    servers = servers or CommandServers(settings, host, base_url, report)
    baseline = _run_arm("baseline", settings, servers, base_url, prompts, gate, report)
    speculative = _run_arm("speculative", settings, servers, base_url, prompts, gate, report, sets)
    return BenchmarkResult(settings.server, settings.steps, baseline, speculative)
