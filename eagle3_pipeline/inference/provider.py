"""The endpoints a pipeline generates against (the `inference` section), resolved lazily and checked by the
health gate before use: the embedded server (:mod:`.embedded`), the configured endpoints, or the managed
server (:mod:`eagle3_pipeline.managed`) made to serve generation first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.config import InferenceConfig, PipelineConfig, TargetConfig
from eagle3_pipeline.generation import Endpoint, Price, Recovered, RecoveryFailed, ServerRecovery
from eagle3_pipeline.health import HealthReport
from eagle3_pipeline.health.gate import HealthMonitor
from eagle3_pipeline.inference.embedded import EmbeddedServer
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed import (
    GENERATION_ACCEPTS,
    EventSink,
    GenerationRecovery,
    generation_purpose,
    managed_server,
    open_supervisor,
)
from eagle3_pipeline.target.local_model import local_model_dir


def tokenizer_name(target: TargetConfig, inference: InferenceConfig, source_file: Path) -> str:
    """The target's tokenizer: `target.tokenizer`, else the embedded model's folder."""
    if target.tokenizer:
        return target.tokenizer
    if inference.kind == "embedded":
        return str(local_model_dir())
    raise ValueError(f"{source_file}: target.tokenizer is not set")


def endpoints_from_config(config: PipelineConfig, api_keys: Mapping[str, str] | None = None) -> list[Endpoint]:
    """Every configured endpoint (``inference.endpoints``, or every host's) as :class:`Endpoint`
    objects, in file order. An endpoint's API key is
    taken from ``api_keys`` (variable → value, as the Dagster resource resolved it), else read from
    its variable."""
    keys = api_keys or {}
    endpoints = []
    for entry in config.inference.all_endpoints:
        price = Price(entry.price.prompt_per_mtok, entry.price.completion_per_mtok) if entry.price else None
        var = entry.api_key_env
        key = keys[var] if var is not None and var in keys else config.api_key(entry)
        endpoints.append(Endpoint(entry.base_url, entry.model or config.target.model, key, price))
    return endpoints


@dataclass(frozen=True)
class ManagedGeneration:
    """What a run that generates asks of the pipeline's managed server: ``reason`` names the run in the
    server's events (e.g. ``responses B1``), ``on_event`` hears them (each start, stop, reuse, failure)."""

    reason: str
    on_event: EventSink


class InferenceProvider:
    """The endpoints a pipeline generates against, resolved lazily.

    ``embedded``: the local model is served on first use and stopped by :meth:`close`.
    ``endpoints``: the configured servers (or ``override``); an endpoint's API key is taken from
    ``api_keys`` (variable → value, as the Dagster resource resolved it), else from its variable.
    A managed server (``serving.managed``, no ``override``): asked with a :class:`ManagedGeneration`,
    :meth:`endpoints` first makes it serve generation (:meth:`Supervisor.ensure`: started when it is
    not running, kept when it serves generation or the trained drafter, replaced when it runs for
    another phase), and :meth:`recovery` is the generation engine's hook that brings it back when it
    dies or hangs mid-run (:class:`~eagle3_pipeline.managed.GenerationRecovery`). :meth:`close` leaves
    it running: the next partition and the served drafter want it, and the GPU-exclusive phases stop
    it through the supervisor.
    Before endpoints are handed out, the health gate runs once on them (the preflight), which asks
    each of them for a 1-token completion: a run started on a sick or unreachable server fails fast
    with the report, naming the endpoint, instead of burning requests.
    """

    def __init__(
        self, config: PipelineConfig, override: Endpoint | None = None, api_keys: Mapping[str, str] | None = None
    ) -> None:
        self.config = config
        self.override = override
        self.api_keys = dict(api_keys or {})
        self._endpoints: list[Endpoint] | None = None
        self._server: EmbeddedServer | None = None
        self.setup = managed_server(config) if override is None else None
        self._managed = contextlib.ExitStack()  # the managed server's supervisor, its host connected
        self._recovery: GenerationRecovery | None = None
        self.preflight_report: HealthReport | None = None

    @property
    def embedded(self) -> bool:
        return self.override is None and self.config.inference.kind == "embedded"

    def endpoints(self, managed: ManagedGeneration | None = None) -> list[Endpoint]:
        """The endpoints, once the health gate passed on them (:class:`UnhealthyError` if not); with
        ``managed``, once the managed server serves generation (class doc)."""
        if self._endpoints is None:
            if managed is not None and self.setup is not None:
                self._serve(managed)
            endpoints = [self._start_embedded()] if self.embedded else self._configured()
            monitor = HealthMonitor(self.config)
            try:
                self.preflight_report = monitor.preflight(running=endpoints[0], sending_to=endpoints)
            finally:
                monitor.close()
            self._endpoints = endpoints
        return self._endpoints

    def recovery(self, managed: ManagedGeneration | None) -> ServerRecovery | None:
        """The generation engine's recovery hook for the managed server (None without one). It covers
        the endpoint that reaches the server, and runs only once :meth:`endpoints` made it serve."""
        if managed is None or self.setup is None:
            return None
        return ServerRecovery(frozenset({self.setup.base_url}), self._recover)

    def _serve(self, managed: ManagedGeneration) -> None:
        supervisor = self._managed.enter_context(open_supervisor(self.config, on_event=managed.on_event))
        assert supervisor is not None  # self.setup is its server's
        purpose = generation_purpose(ArtifactLayout(self.config.artifacts_root), self.config.dataset_ids)
        self._recovery = GenerationRecovery(supervisor, purpose, managed.reason, GENERATION_ACCEPTS)
        supervisor.ensure(purpose, managed.reason, accept=GENERATION_ACCEPTS)

    def _recover(self, failure: str) -> Recovered:
        if self._recovery is None:
            raise RecoveryFailed("the managed server was never asked to serve this run, so it has nothing to recover")
        return self._recovery(failure)

    def tokenizer_name(self) -> str:
        config = self.config
        return tokenizer_name(config.target, config.inference, config.source_file)

    def _start_embedded(self) -> Endpoint:
        settings = self.config.inference.embedded
        self._server = EmbeddedServer(
            local_model_dir(),
            ArtifactLayout(self.config.artifacts_root).server_log,
            port=settings.port,
            startup_timeout_s=settings.startup_timeout_s,
            continuous_batching=settings.continuous_batching,
            cb_num_blocks=settings.cb_num_blocks,
            cb_block_size=settings.cb_block_size,
        )
        base_url = self._server.start()
        return Endpoint(base_url=base_url, model=self._server.model)

    def _configured(self) -> list[Endpoint]:
        if self.override is not None:
            return [self.override]
        return endpoints_from_config(self.config, self.api_keys)

    def close(self) -> None:
        """Stop the embedded server; a managed one is left running (class doc), its host disconnected."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._managed.close()
        self._recovery = None
        self._endpoints = None
