"""A pipeline's health gate: its config → the host to probe, the server to check, the thresholds.

Used by the health sensor (every tick), by the GPU-bound assets as a preflight (a run started from
the UI on a sick server fails fast), and by `eagle3-pipeline status`. The endpoints it is given are read
through :class:`Served` (generation's ``Endpoint`` is one), so the probes know nothing of the phases.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from eagle3_pipeline.config import HealthConfig, InferenceConfig, PipelineConfig
from eagle3_pipeline.health import (
    GenerationTarget,
    HealthReport,
    HealthThresholds,
    ServerSpec,
    TickState,
    run_health_tick,
    server_root,
)
from eagle3_pipeline.hosts import Host, build_host

EMBEDDED_NOT_RUNNING = (
    "no embedded server to ask: each run starts its own and probes it (this gate, as the run's "
    "preflight) before sending work"
)


class Served(Protocol):
    """An endpoint work is sent to, as the gate reads it."""

    @property
    def base_url(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def api_key(self) -> str | None: ...


class UnhealthyError(RuntimeError):
    """The gate refused: the message is the report's one-line summary."""

    def __init__(self, report: HealthReport) -> None:
        super().__init__(f"health gate refused: {report.summary()}")
        self.report = report


def thresholds_for(health: HealthConfig, artifacts_root: Path) -> HealthThresholds:
    """The tick's thresholds from the `health` section; a local host watches `artifacts_root`
    for progress unless `health.watch_dir` names another folder."""
    local = health.host.kind == "local"
    watch = health.watch_dir or (str(artifacts_root) if local else None)
    return HealthThresholds(
        expected_gpus=health.expected_gpus,
        min_disk_free_gb=health.min_disk_free_gb,
        min_mem_free_gb=health.min_mem_free_gb,
        stall_window_s=health.stall_window_s,
        artifacts_dir=watch,
        log_path=health.server.log_path if health.server else None,
        shell_section_timeout_s=health.shell_section_timeout_s,
        generation_timeout_s=health.generation_timeout_s,
        tick_timeout_s=health.tick_timeout_s,
        hosted_probe_interval_s=health.hosted_probe_interval_s,
        kernel_log_path=health.kernel_log_path,
        optional_checks=frozenset(health.optional_checks),
    )


def _key(variable: str | None) -> str | None:
    """An API key from its variable; unset is reported by the probe, not raised here."""
    return os.environ.get(variable) if variable else None


def generation_targets(
    inference: InferenceConfig, target_model: str, sending_to: Sequence[Served] | None = None
) -> list[GenerationTarget]:
    """Every server work is sent to: `sending_to` when the caller knows (the endpoints a run has
    resolved: the embedded server once up, or an override), else each configured endpoint (whose
    model defaults to `target_model`)."""
    if sending_to is not None:
        return [GenerationTarget(base_url=e.base_url, model=e.model, api_key=e.api_key) for e in sending_to]
    if inference.kind != "endpoints":
        return []
    return [
        GenerationTarget(
            base_url=entry.base_url,
            model=entry.model or target_model,
            api_key=_key(entry.api_key_env),
            api_key_env=entry.api_key_env,
        )
        for entry in inference.endpoints
    ]


def server_spec_for(
    health: HealthConfig,
    inference: InferenceConfig,
    target_model: str,
    source_file: Path,
    running: Served | None = None,
) -> ServerSpec | None:
    """The server whose process, port and throughput are checked on the host: the configured one;
    the embedded one once started; else none."""
    server = health.server
    if server is not None:
        endpoint = inference.endpoints[0] if inference.endpoints else None
        base_url = (
            server.base_url or (endpoint.base_url if endpoint else None) or (running.base_url if running else None)
        )
        if base_url is None:
            raise ValueError(f"{source_file}: health.server.base_url is needed (no inference endpoint to default to)")
        model = (endpoint.model if endpoint else None) or target_model
        return ServerSpec(
            kind=server.kind,
            port=server.port,
            base_url=server_root(base_url),
            model=running.model if running else model,
            tp_size=server.tp_size,
            process_pattern=server.process_pattern,
            generation_probe=server.generation_probe,
            api_key=_key(endpoint.api_key_env) if endpoint else None,
        )
    if running is not None and inference.kind == "embedded":
        port = urlsplit(running.base_url).port
        assert port is not None
        return ServerSpec(
            kind="transformers",
            port=port,
            base_url=server_root(running.base_url),
            model=running.model,
            tp_size=1,
            process_pattern=r"eagle3_pipeline\.inference\.embedded .*\"serve\"",
        )
    return None


class HealthMonitor:
    """Runs ticks for one pipeline, keeping one host connection across them."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.thresholds = thresholds_for(config.health, config.artifacts_root)
        self._host: Host | None = None

    @property
    def host(self) -> Host:
        if self._host is None:
            self._host = build_host(self.config.health.host)
        return self._host

    def tick(
        self,
        state: TickState | None = None,
        running: Served | None = None,
        sending_to: Sequence[Served] | None = None,
    ) -> tuple[HealthReport, TickState]:
        """One tick. `running` is the embedded server once started (its process, port and
        generation are checked); `sending_to` the endpoints work is about to go to, when a run has
        resolved them (default: the configured ones). With the embedded profile and no server up,
        `generation` is UNKNOWN and optional: the run that starts the server probes it first."""
        targets = generation_targets(self.config.inference, self.config.target.model, sending_to)
        deferred = EMBEDDED_NOT_RUNNING if self.config.inference.kind == "embedded" and running is None else None
        config = self.config
        spec = server_spec_for(config.health, config.inference, config.target.model, config.source_file, running)
        return run_health_tick(self.host, spec, self.thresholds, state, targets=targets, deferred=deferred)

    def preflight(self, running: Served | None = None, sending_to: Sequence[Served] | None = None) -> HealthReport:
        """One tick; raises :class:`UnhealthyError` unless every required check passes."""
        report, _ = self.tick(running=running, sending_to=sending_to)
        if not report.healthy:
            raise UnhealthyError(report)
        return report

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None
