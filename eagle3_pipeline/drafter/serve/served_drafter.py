"""The served drafter: the managed server relaunched with the newly trained drafter when it beats the one it
serves, with the previous launch kept to roll back to.

1. **The candidate**: the export of the drafter just trained, on the managed server's host (where it was
   trained: ``compute.artifacts_root`` on a GPU host), named by the SHA-256 of its files
   (:func:`~eagle3_pipeline.drafter.serve.record.drafter_digest`), in the speculative configuration the
   benchmark chose for this very drafter at ``drafter_benchmark.serve_concurrency`` (the most output tokens/s
   there), else at drafter_eval's K with the best estimated speedup (a chain). Its τ: drafter_eval's
   ``tau@K/all`` (offline), and the benchmark's τ from the server's counters for that configuration.
2. **The decision** against the record (``served_drafter.json`` under the artifacts root): when the benchmark
   of this drafter found no configuration faster than the target alone at the serving concurrency, the target
   is served without a drafter (the generation launch line), and the record and metadata say so with the
   figures; with no drafter served, the candidate is served; the same drafter (digest and configuration) is
   served again as recorded; otherwise
   the candidate replaces the served one only when its τ is higher — the benchmark's τ when both have one,
   else drafter_eval's. A candidate that does not beat the served drafter leaves that one served (started
   again from its recorded launch line if a hand-over stopped it).
3. **The launch**: the candidate is copied to ``drafter/served/<digest>`` beside the export (a later training
   replaces the export, never a served copy, so a recorded launch line keeps meaning what it served) and the
   server is started with it (``ServerPurpose.served_drafter``, chat parsers as for generation). If it fails
   to start, the previous launch line is started again as recorded, and the asset fails with the reason.
4. **The served τ**, measured on the running server from its own counters (vLLM ``/metrics``, SGLang
   ``meta_info``: :func:`~eagle3_pipeline.drafter.serve.client.measure`) over ``serving.served_drafter_prompts``
   eval prompts, is recorded and returned.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.config import ComputeConfig, DrafterBenchmarkConfig, DrafterEvalConfig, PipelineConfig
from eagle3_pipeline.drafter.serve.benchmark import eval_prompts
from eagle3_pipeline.drafter.serve.client import Measured, measure
from eagle3_pipeline.drafter.serve.record import drafter_digest
from eagle3_pipeline.drafter.serve.sweep import SpeculativeConfig
from eagle3_pipeline.drafter.spec import drafter_paths
from eagle3_pipeline.health import server_root
from eagle3_pipeline.hosts import quote_args
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed import EagleDrafter, LaunchLine, ServerPurpose, StartupFailedError, Supervisor
from eagle3_pipeline.managed.phases import phase_host, same_machine
from eagle3_pipeline.managed.servers import generation_purpose
from eagle3_pipeline.records import atomic_path

SERVED_FOLDER = "served"
COPY_TIMEOUT_S = 1800.0
REQUEST_TIMEOUT_S = 600.0
RECORD_VERSION = 1


class ServedDrafterError(RuntimeError):
    """The drafter cannot be served (none exported, another machine, a start that failed): the message says why."""


@dataclass(frozen=True)
class ServedDrafter:
    """A drafter served (or to be served): its folder on the host, identity, depth, τ and launch line."""

    drafter: str
    digest: str
    steps: int
    tau_eval: float | None  # drafter_eval's tau@K/all
    tau_benchmark: float | None  # drafter_benchmark's τ from the server's counters, for this drafter at K
    argv: tuple[str, ...] = ()
    served_at: str = ""
    tau_served: float | None = None  # measured on the served server after its launch
    topk: int = 1
    draft_tokens: int | None = None  # None: K + 1 (a chain)

    def eagle(self) -> EagleDrafter:
        return self.config().drafter(self.drafter)

    def config(self) -> SpeculativeConfig:
        return SpeculativeConfig(self.steps, self.topk, self.draft_tokens)

    def basis(self, other: ServedDrafter) -> tuple[str, float | None, float | None]:
        """(what τ compares, this one's, the other's): the benchmark's τ when both have it, else drafter_eval's."""
        if self.tau_benchmark is not None and other.tau_benchmark is not None:
            return "drafter_benchmark τ from the server's counters", self.tau_benchmark, other.tau_benchmark
        return "drafter_eval τ", self.tau_eval, other.tau_eval

    def same(self, other: ServedDrafter) -> bool:
        return self.digest == other.digest and self.config() == other.config()


@dataclass(frozen=True)
class ServedRecord:
    """The drafter served (None: the target alone, ``baseline_reason`` says why) and the one before it."""

    current: ServedDrafter | None
    previous: ServedDrafter | None = None
    baseline_reason: str | None = None

    def to_json(self) -> str:
        return json.dumps({"version": RECORD_VERSION, **asdict(self)}, indent=1)

    @classmethod
    def read(cls, path: Path) -> ServedRecord | None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ServedDrafterError(f"{path}: not a record this pipeline wrote ({exc})") from None
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            raise ServedDrafterError(f"{path}: not a record this pipeline wrote (expected version {RECORD_VERSION})")

        def one(value: Any) -> ServedDrafter | None:
            return None if value is None else ServedDrafter(**{**value, "argv": tuple(value.get("argv") or ())})

        current = one(data.get("current"))
        reason = data.get("baseline_reason")
        if current is None and not reason:
            raise ServedDrafterError(f"{path}: no current drafter recorded")
        return cls(current, one(data.get("previous")), reason)

    def write(self, path: Path) -> None:
        with atomic_path(path) as tmp:
            tmp.write_text(self.to_json())


@dataclass
class ServedResult:
    """What the served_drafter asset reports: the decision, the drafter served now, its τ from the server."""

    decision: str
    served: ServedDrafter | None  # None: the target alone
    candidate: ServedDrafter
    measured: Measured

    def as_metadata(self) -> dict[str, Any]:
        acceptance = self.measured.acceptance
        per_position = acceptance.per_position if acceptance is not None else None
        return {
            "decision": self.decision,
            "tau_served": round(acceptance.tau, 4) if acceptance is not None else None,
            "tau_served_verify_steps": acceptance.verify_steps if acceptance is not None else None,
            **{f"tau_served_pos{p}": round(rate, 4) for p, rate in enumerate(per_position or [])},
            "tau_served_prompts": self.measured.requests,
            "tau_served_completion_tokens": self.measured.completion_tokens,
            "served_tokens_per_s": round(self.measured.tokens_per_s, 2),
            **(self._served() if self.served is not None else {"served_drafter": "none: the target alone"}),
            "candidate_digest": self.candidate.digest[:16],
            "candidate_config": self.candidate.config().label,
            "candidate_tau_eval": self.candidate.tau_eval,
            "candidate_tau_benchmark": self.candidate.tau_benchmark,
        }

    def _served(self) -> dict[str, Any]:
        served = self.served
        assert served is not None
        return {
            "served_drafter": served.drafter,
            "served_digest": served.digest[:16],
            "served_steps": served.steps,
            "served_topk": served.topk,
            "served_draft_tokens": served.eagle().verified,
            "served_tau_eval": served.tau_eval,
            "served_tau_benchmark": served.tau_benchmark,
            "command": " ".join(served.argv),
        }


def drafter_depth(
    benchmark: DrafterBenchmarkConfig | None, drafter_eval: DrafterEvalConfig, evaluation: Mapping[str, Any]
) -> int:
    """K: drafter_benchmark's when configured, else drafter_eval's K with the best estimated speedup (its first
    K when none is recorded)."""
    if benchmark is not None:
        return benchmark.steps
    speedups = {k: evaluation.get(f"speedup_est@{k}/all") for k in drafter_eval.steps}
    known = {k: float(v) for k, v in speedups.items() if isinstance(v, (int, float))}
    return max(known, key=lambda k: known[k]) if known else drafter_eval.steps[0]


def host_root(compute: ComputeConfig, artifacts_root: Path) -> str:
    """The artifacts root where the drafter is trained and exported (the GPU host's with compute ssh)."""
    if compute.kind != "local" and compute.artifacts_root is not None:
        return compute.artifacts_root
    return str(artifacts_root)


@dataclass(frozen=True)
class BenchmarkChoice:
    """What drafter_benchmark chose for a drafter: the configuration (None: the target alone), why, its τ."""

    config: SpeculativeConfig | None
    reason: str
    tau: float | None


def benchmark_choice(layout: ArtifactLayout, digest: str) -> BenchmarkChoice | None:
    """The choice drafter_benchmark recorded for this drafter (by content), or None when it recorded none."""
    try:
        record = json.loads(layout.drafter_benchmark.read_text())
    except (OSError, ValueError):
        return None
    identity = record.get("identity") if isinstance(record, dict) else None
    result = record.get("result") if isinstance(record, dict) else None
    if not isinstance(identity, dict) or identity.get("drafter") != digest or not isinstance(result, dict):
        return None
    choice = result.get("choice")
    if not isinstance(choice, dict) or not isinstance(choice.get("reason"), str):
        return None
    chosen = choice.get("config")
    if not isinstance(chosen, dict):
        return BenchmarkChoice(None, choice["reason"], None)
    config = SpeculativeConfig(int(chosen["steps"]), int(chosen["topk"]), int(chosen["draft_tokens"]))
    arms = [a for a in result.get("arms") or [] if isinstance(a, dict) and a.get("config") == config.as_dict()]
    tau = arms[0].get("tau") if arms else None
    return BenchmarkChoice(config, choice["reason"], float(tau) if isinstance(tau, (int, float)) else None)


def candidate(
    config: PipelineConfig, supervisor: Supervisor, evaluation: Mapping[str, Any]
) -> tuple[ServedDrafter, BenchmarkChoice | None]:
    """The drafter just trained, as exported on the server's host, in its configuration, with its τ and the
    benchmark's choice for it (module doc, step 1)."""
    setup = supervisor.server.setup
    trained_on = phase_host(config.compute, config.health, "eagle3_drafter")
    if not same_machine(trained_on, setup.host):
        raise ServedDrafterError(
            f"{config.source_file}: the drafter is trained and exported on "
            f"{trained_on.hostname or 'this machine'} (compute), but the managed server ({setup.setting}) runs on "
            f"{setup.host.hostname or 'this machine'}: it cannot load the export from there"
        )
    export = str(drafter_paths(Path(host_root(config.compute, config.artifacts_root)))["export_dir"])
    host = supervisor.server.host
    digest = drafter_digest(host, export)
    if digest is None:
        raise ServedDrafterError(f"{export} on {host.name}: no exported drafter to serve; materialize eagle3_drafter")
    choice = benchmark_choice(ArtifactLayout(config.artifacts_root), digest)
    chosen = choice.config if choice is not None else None
    if chosen is None:
        chosen = SpeculativeConfig(drafter_depth(config.drafter_benchmark, config.drafter_eval, evaluation))
    tau_eval = evaluation.get(f"tau@{chosen.steps}/all")
    drafter = ServedDrafter(
        drafter=export,
        digest=digest,
        steps=chosen.steps,
        tau_eval=float(tau_eval) if isinstance(tau_eval, (int, float)) else None,
        tau_benchmark=choice.tau if choice is not None else None,
        topk=chosen.topk,
        draft_tokens=chosen.draft_tokens if chosen.topk > 1 else None,
    )
    return drafter, choice


def decide(new: ServedDrafter, record: ServedRecord | None) -> tuple[bool, str]:
    """(serve the candidate, why) — module doc, step 2."""
    if record is None:
        return True, "no drafter is served yet"
    served = record.current
    if served is None:
        return True, "the target is served alone, and the benchmark found the new drafter faster"
    if new.same(served):
        return False, "the same drafter (files and configuration) is served already"
    basis, mine, theirs = new.basis(served)
    if mine is None:
        return False, f"the new drafter has no {basis} to compare; the served one stays"
    if theirs is None or mine > theirs:
        shown = "none" if theirs is None else f"{theirs:.4f}"
        return True, f"the new drafter's {basis} {mine:.4f} beats the served one's ({shown})"
    return False, f"the new drafter's {basis} {mine:.4f} does not beat the served one's {theirs:.4f}"


def _served_copy(supervisor: Supervisor, new: ServedDrafter) -> ServedDrafter:
    """The candidate copied beside the export under its digest (module doc, step 3)."""
    folder = f"{str(Path(new.drafter).parent / SERVED_FOLDER)}/{new.digest[:16]}"
    command = (
        f"[ -d {quote_args(folder)} ] || {{ mkdir -p {quote_args(str(Path(folder).parent))} && "
        f"cp -a {quote_args(new.drafter)} {quote_args(folder + '.tmp')} && mv {quote_args(folder + '.tmp')} "
        f"{quote_args(folder)}; }}"
    )
    result = supervisor.server.host.run(command, COPY_TIMEOUT_S)
    if not result.ok:
        raise ServedDrafterError(
            f"cannot copy the drafter {new.drafter} to {folder} on {supervisor.server.host.name}: "
            f"{result.stderr.strip()[:300]}"
        )
    return replace(new, drafter=folder)


def _recorded_line(supervisor: Supervisor, served: ServedDrafter, purpose: ServerPurpose) -> LaunchLine:
    """The served drafter's recorded launch line (its environment from the settings now: values are not kept)."""
    current = supervisor.launch(purpose)
    return replace(current, argv=served.argv) if served.argv else current


def serve_drafter(
    config: PipelineConfig,
    supervisor: Supervisor,
    evaluation: Mapping[str, Any],
    report: Reporter,
) -> ServedResult:
    """Serve the trained drafter in the benchmark's configuration when it beats the served one, the target alone
    when the benchmark found no configuration faster, or keep the served one; measure it on the server (module
    doc). Raises :class:`ServedDrafterError` after a rollback."""
    layout = ArtifactLayout(config.artifacts_root)
    record = ServedRecord.read(layout.served_drafter)
    new, choice = candidate(config, supervisor, evaluation)
    tools = generation_purpose(layout, config.dataset_ids).needs_tools  # chat as generation serves it
    if choice is not None and choice.config is None:
        return _serve_baseline(
            layout, supervisor, record=record, new=new, reason=choice.reason, tools=tools, report=report
        )
    serve_new, why = decide(new, record)
    report.log(f"served_drafter: {why}")
    if serve_new:
        new = _served_copy(supervisor, new)
        try:
            line = supervisor.ensure(ServerPurpose.served_drafter(new.eagle(), tools), f"served_drafter: {why}")
        except StartupFailedError as exc:
            _roll_back(supervisor, record, tools, exc)
        now = ServedRecord(
            replace(new, argv=line.argv, served_at=datetime.now(UTC).isoformat(timespec="seconds")),
            record.current if record is not None and record.current is not None else None,
        )
        decision = "served the new drafter"
    else:
        assert record is not None and record.current is not None
        served = record.current
        purpose = ServerPurpose.served_drafter(served.eagle(), tools)
        line = supervisor.ensure_launch(_recorded_line(supervisor, served, purpose), f"served_drafter: {why}")
        now = ServedRecord(replace(served, argv=line.argv), record.previous)
        decision = "kept the served drafter"
    assert now.current is not None
    measured = measure_served(layout, supervisor, speculative=True)
    acceptance = measured.acceptance
    tau = acceptance.tau if acceptance is not None else None
    current = replace(now.current, tau_served=round(tau, 4) if tau is not None else None)
    replace(now, current=current).write(layout.served_drafter)
    report.log(
        f"served_drafter: {decision} ({current.drafter}, {current.config().label}); τ from the server's counters "
        f"{'unknown' if tau is None else f'{tau:.4f}'} over {measured.requests} eval prompts"
    )
    return ServedResult(f"{decision}: {why}", current, new, measured)


def _roll_back(supervisor: Supervisor, record: ServedRecord | None, tools: bool, exc: StartupFailedError) -> NoReturn:
    """After the new drafter's server failed to start: the drafter served before (or the target alone) started
    again from its recorded line; raises :class:`ServedDrafterError` with the reason."""
    if record is None:
        raise ServedDrafterError(f"the new drafter's server did not start, and none was served before: {exc}") from None
    previous = record.current
    if previous is None:
        supervisor.ensure(ServerPurpose.generation(tools), "served_drafter: roll back to the target alone")
        raise ServedDrafterError(
            f"the new drafter's server did not start; the target alone is served again: {exc}"
        ) from None
    back = ServerPurpose.served_drafter(previous.eagle(), tools)
    supervisor.ensure_launch(
        _recorded_line(supervisor, previous, back), "served_drafter: roll back to the drafter served before"
    )
    raise ServedDrafterError(
        f"the new drafter's server did not start; rolled back to the drafter served before "
        f"({previous.drafter}, K={previous.steps}): {exc}"
    ) from None


def _serve_baseline(
    layout: ArtifactLayout,
    supervisor: Supervisor,
    *,
    record: ServedRecord | None,
    new: ServedDrafter,
    reason: str,
    tools: bool,
    report: Reporter,
) -> ServedResult:
    """The target alone (its generation launch line), since no configuration beat it in the benchmark; the
    drafter served before, if any, is kept in the record as the previous one."""
    why = f"the target is served without a drafter: {reason}"
    report.log(f"served_drafter: {why}")
    supervisor.ensure(ServerPurpose.generation(tools), f"served_drafter: {why}")
    previous = (record.current or record.previous) if record is not None else None
    ServedRecord(None, previous, reason).write(layout.served_drafter)
    measured = measure_served(layout, supervisor, speculative=False)
    report.log(f"served_drafter: the target alone makes {measured.tokens_per_s:.1f} output tokens/s")
    return ServedResult(why, None, new, measured)


def measure_served(layout: ArtifactLayout, supervisor: Supervisor, speculative: bool) -> Measured:
    """The running server over a few eval prompts: tokens/s, and τ from its counters when it speculates
    (module doc, step 4)."""
    setup = supervisor.server.setup
    count = setup.serving.served_drafter_prompts
    prompts = eval_prompts(layout.training_data, count)
    return measure(
        setup.engine,
        server_root(setup.base_url),
        prompts=prompts,
        max_tokens=setup.serving.served_drafter_max_tokens,
        concurrency=len(prompts),
        timeout_s=REQUEST_TIMEOUT_S,
        speculative=speculative,
        api_key=setup.api_key(),
    )
