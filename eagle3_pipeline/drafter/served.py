"""The served drafter: the managed server relaunched with the newly trained drafter when it beats the one it
serves, with the previous launch kept to roll back to.

1. **The candidate**: the export of the drafter just trained, on the managed server's host (where it was
   trained: ``compute.artifacts_root`` on a GPU host), named by the SHA-256 of its files
   (:func:`~eagle3_pipeline.drafter.benchmark_record.drafter_digest`), at the draft depth K of
   ``drafter_benchmark.steps`` when the benchmark is configured, else drafter_eval's K with the best
   estimated speedup. Its τ: drafter_eval's ``tau@K/all`` (offline), and the benchmark's τ from the server's
   counters (``tau_server``) when the benchmark recorded one for this very drafter at that K.
2. **The decision** against the record (``served_drafter.json`` under the artifacts root): with no drafter
   served, the candidate is served; the same drafter (digest and K) is served again as recorded; otherwise
   the candidate replaces the served one only when its τ is higher — the benchmark's τ when both have one,
   else drafter_eval's. A candidate that does not beat the served drafter leaves that one served (started
   again from its recorded launch line if a hand-over stopped it).
3. **The launch**: the candidate is copied to ``drafter/served/<digest>`` beside the export (a later training
   replaces the export, never a served copy, so a recorded launch line keeps meaning what it served) and the
   server is started with it (``ServerPurpose.served_drafter``, chat parsers as for generation). If it fails
   to start, the previous launch line is started again as recorded, and the asset fails with the reason.
4. **The served τ**, measured on the running server from its own counters (vLLM ``/metrics``, SGLang
   ``meta_info``: :func:`~eagle3_pipeline.drafter.online.measure`) over ``serving.served_drafter_prompts``
   eval prompts, is recorded and returned.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.config import ComputeConfig, DrafterBenchmarkConfig, DrafterEvalConfig, PipelineConfig
from eagle3_pipeline.drafter.benchmark_record import drafter_digest
from eagle3_pipeline.drafter.online import Measured, eval_prompts, measure
from eagle3_pipeline.drafter.spec import drafter_paths
from eagle3_pipeline.health import server_root
from eagle3_pipeline.hosts import quote_args
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed import EagleDrafter, LaunchLine, ServerPurpose, StartupFailedError, Supervisor
from eagle3_pipeline.managed.phases import phase_host, same_machine
from eagle3_pipeline.managed.plan import generation_purpose
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

    def basis(self, other: ServedDrafter) -> tuple[str, float | None, float | None]:
        """(what τ compares, this one's, the other's): the benchmark's τ when both have it, else drafter_eval's."""
        if self.tau_benchmark is not None and other.tau_benchmark is not None:
            return "drafter_benchmark τ from the server's counters", self.tau_benchmark, other.tau_benchmark
        return "drafter_eval τ", self.tau_eval, other.tau_eval

    def same(self, other: ServedDrafter) -> bool:
        return self.digest == other.digest and self.steps == other.steps


@dataclass(frozen=True)
class ServedRecord:
    current: ServedDrafter
    previous: ServedDrafter | None = None

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
        if current is None:
            raise ServedDrafterError(f"{path}: no current drafter recorded")
        return cls(current, one(data.get("previous")))

    def write(self, path: Path) -> None:
        with atomic_path(path) as tmp:
            tmp.write_text(self.to_json())


@dataclass
class ServedResult:
    """What the served_drafter asset reports: the decision, the drafter served now, its τ from the server."""

    decision: str
    served: ServedDrafter
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
            "served_drafter": self.served.drafter,
            "served_digest": self.served.digest[:16],
            "served_steps": self.served.steps,
            "served_tau_eval": self.served.tau_eval,
            "served_tau_benchmark": self.served.tau_benchmark,
            "candidate_digest": self.candidate.digest[:16],
            "candidate_tau_eval": self.candidate.tau_eval,
            "candidate_tau_benchmark": self.candidate.tau_benchmark,
            "command": " ".join(self.served.argv),
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


def candidate(config: PipelineConfig, supervisor: Supervisor, evaluation: Mapping[str, Any]) -> ServedDrafter:
    """The drafter just trained, as exported on the server's host, with its τ (module doc, step 1)."""
    plan = supervisor.server.plan
    trained_on = phase_host(config.compute, config.health, "eagle3_drafter")
    if not same_machine(trained_on, plan.host):
        raise ServedDrafterError(
            f"{config.source_file}: the drafter is trained and exported on "
            f"{trained_on.hostname or 'this machine'} (compute), but the managed server ({plan.setting}) runs on "
            f"{plan.host.hostname or 'this machine'}: it cannot load the export from there"
        )
    export = str(drafter_paths(Path(host_root(config.compute, config.artifacts_root)))["export_dir"])
    host = supervisor.server.host
    digest = drafter_digest(host, export)
    if digest is None:
        raise ServedDrafterError(f"{export} on {host.name}: no exported drafter to serve; materialize eagle3_drafter")
    steps = drafter_depth(config.drafter_benchmark, config.drafter_eval, evaluation)
    tau_eval = evaluation.get(f"tau@{steps}/all")
    return ServedDrafter(
        drafter=export,
        digest=digest,
        steps=steps,
        tau_eval=float(tau_eval) if isinstance(tau_eval, (int, float)) else None,
        tau_benchmark=benchmark_tau(ArtifactLayout(config.artifacts_root), digest, steps),
    )


def benchmark_tau(layout: ArtifactLayout, digest: str, steps: int) -> float | None:
    """drafter_benchmark's τ from the server's counters, when it recorded one for this drafter at ``steps``."""
    path = layout.drafter_benchmark
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    identity = record.get("identity") if isinstance(record, dict) else None
    result = record.get("result") if isinstance(record, dict) else None
    if not isinstance(identity, dict) or identity.get("drafter") != digest or not isinstance(result, dict):
        return None
    if result.get("steps") != steps or not isinstance(result.get("tau_server"), (int, float)):
        return None
    return float(result["tau_server"])


def decide(new: ServedDrafter, record: ServedRecord | None) -> tuple[bool, str]:
    """(serve the candidate, why) — module doc, step 2."""
    if record is None:
        return True, "no drafter is served yet"
    served = record.current
    if new.same(served):
        return False, "the same drafter (files and K) is served already"
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
    """Serve the trained drafter when it beats the served one, or keep that one served; measure its τ on the
    server (module doc). Raises :class:`ServedDrafterError` after a rollback."""
    layout = ArtifactLayout(config.artifacts_root)
    record = ServedRecord.read(layout.served_drafter)
    new = candidate(config, supervisor, evaluation)
    serve_new, why = decide(new, record)
    report.log(f"served_drafter: {why}")
    tools = generation_purpose(layout, config.dataset_ids).needs_tools  # chat as generation serves it
    if serve_new:
        new = _served_copy(supervisor, new)
        purpose = ServerPurpose.served_drafter(EagleDrafter(new.drafter, new.steps), tools)
        try:
            line = supervisor.ensure(purpose, f"served_drafter: {why}")
        except StartupFailedError as exc:
            if record is None:
                raise ServedDrafterError(
                    f"the new drafter's server did not start, and none was served before: {exc}"
                ) from None
            previous = record.current
            back = ServerPurpose.served_drafter(EagleDrafter(previous.drafter, previous.steps), tools)
            supervisor.ensure_launch(
                _recorded_line(supervisor, previous, back), "served_drafter: roll back to the drafter served before"
            )
            raise ServedDrafterError(
                f"the new drafter's server did not start; rolled back to the drafter served before "
                f"({previous.drafter}, K={previous.steps}): {exc}"
            ) from None
        now = ServedRecord(
            replace(new, argv=line.argv, served_at=datetime.now(UTC).isoformat(timespec="seconds")),
            record.current if record is not None else None,
        )
        decision = "served the new drafter"
    else:
        assert record is not None
        served = record.current
        purpose = ServerPurpose.served_drafter(EagleDrafter(served.drafter, served.steps), tools)
        line = supervisor.ensure_launch(_recorded_line(supervisor, served, purpose), f"served_drafter: {why}")
        now = ServedRecord(replace(served, argv=line.argv), record.previous)
        decision = "kept the served drafter"
    measured = measure_served(layout, supervisor)
    acceptance = measured.acceptance
    tau = acceptance.tau if acceptance is not None else None
    now = replace(now, current=replace(now.current, tau_served=round(tau, 4) if tau is not None else None))
    now.write(layout.served_drafter)
    report.log(
        f"served_drafter: {decision} ({now.current.drafter}, K={now.current.steps}); τ from the server's counters "
        f"{'unknown' if tau is None else f'{tau:.4f}'} over {measured.requests} eval prompts"
    )
    return ServedResult(f"{decision}: {why}", now.current, new, measured)


def measure_served(layout: ArtifactLayout, supervisor: Supervisor) -> Measured:
    """τ of the running served drafter from its server's counters over a few eval prompts (module doc, step 4)."""
    plan = supervisor.server.plan
    count = plan.serving.served_drafter_prompts
    prompts = eval_prompts(layout.training_data, count)
    return measure(
        plan.engine,
        server_root(plan.base_url),
        prompts,
        plan.serving.served_drafter_max_tokens,
        len(prompts),
        REQUEST_TIMEOUT_S,
        speculative=True,
        api_key=plan.api_key(),
    )
