"""Resources: the pipeline's settings, and the inference endpoint (embedded server started for the
run, or a remote one).

Settings reach every asset, check, sensor and automation condition through :class:`PipelineResource`,
read when a run or tick needs them (``pipeline.config()``), so a deployment overrides them per code
location in its ``Definitions`` (or ``materialize(..., resources=...)``) without editing the file.
Only the graph's shape — which assets exist, the partitions (the file's dataset ids), code versions,
descriptions — is read from the file when the code location loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import dagster as dg
from pydantic import Field, PrivateAttr

from eagle3_pipeline.config import PipelineConfig, load_config
from eagle3_pipeline.generation import Endpoint, ServerRecovery
from eagle3_pipeline.health import HealthReport
from eagle3_pipeline.hosts import TUNNELS
from eagle3_pipeline.inference.provider import InferenceProvider, ManagedGeneration
from eagle3_pipeline.managed.tunnels import declare_tunnels
from eagle3_pipeline.orchestration.hosts import claim_host
from eagle3_pipeline.orchestration.names import PipelineNames
from eagle3_pipeline.orchestration.partition_runs import HOST_TAG
from eagle3_pipeline.results import PhaseListener

T = TypeVar("T")


def run_host(run: dg.DagsterRun | None) -> str | None:
    """The inference host a run was placed on (tag `eagle3/host`), or None."""
    return run.tags.get(HOST_TAG) if run is not None else None


class PipelineResource(dg.ConfigurableResource):
    """The pipeline file and a deployment's overrides of it. ``artifacts_root`` (absolute, or
    relative to the working directory of the run) replaces the file's, for every phase."""

    config_path: str
    artifacts_root: str | None = None
    key_prefix: str | None = Field(
        default=None,
        description="The prefix of this pipeline's names in the code location (asset keys `<prefix>/prompts`, "
        "job `<prefix>__generation_job`, ...); empty: the plain names. Set by the component's key_prefix.",
    )

    def names(self) -> PipelineNames:
        """The names of this pipeline's assets, checks, jobs, sensors and resources."""
        return PipelineNames(self.key_prefix)

    def config(self) -> PipelineConfig:
        """The settings now: the file read afresh (without the run-time checks, which the phases
        that need sources or keys make themselves), with this resource's overrides applied; the tunnels
        its managed servers need are declared (:mod:`eagle3_pipeline.managed.tunnels`): opened on first use in
        this process, closed by the inference resource's teardown, a step's end or the process's."""
        config = load_config(self.config_path, runtime_checks=False)
        if self.artifacts_root:
            config = config.model_copy(update={"artifacts_root": Path(self.artifacts_root).expanduser().resolve()})
        declare_tunnels(config)
        return config


class StepResources:
    """One pipeline's resources in an asset, check or sensor, each as its type.

    Dagster's typed resource parameters take their key from the parameter's name, and a code location
    with two pipelines needs two keys for each: every pipeline resolves its own API-key variables and
    claims its own inference hosts when a run sets up `inference`, so one resource shared by both would
    fail one pipeline's runs on the other's unset key. The keys are therefore prefixed
    (:class:`~eagle3_pipeline.orchestration.names.PipelineNames`), and this class is the one place that
    reads a resource by its key; a resource of another type fails naming the key."""

    def __init__(self, context: Any, names: PipelineNames) -> None:
        self.context = context
        self.names = names

    @classmethod
    def of_asset(cls, context: dg.AssetExecutionContext | dg.AssetCheckExecutionContext) -> StepResources:
        """The resources of the pipeline the asset (or the checked asset) belongs to, known from its key."""
        if isinstance(context, dg.AssetCheckExecutionContext):
            key = context.check_specs[0].asset_key
        else:
            key = context.asset_key
        return cls(context, PipelineNames.of_key(key))

    def _get(self, key: str, kind: type[T]) -> T:
        value = getattr(self.context.resources, key)
        if not isinstance(value, kind):
            raise TypeError(f"resource {key!r}: expected a {kind.__name__}, got {type(value).__name__}")
        return value

    @property
    def pipeline(self) -> PipelineResource:
        return self._get(self.names.pipeline, PipelineResource)

    def config(self) -> PipelineConfig:
        """The settings of this run or tick: the pipeline file as read now (:meth:`PipelineResource.config`)."""
        return self.pipeline.config()

    @property
    def inference(self) -> InferenceResource:
        return self._get(self.names.inference, InferenceResource)

    @property
    def listener(self) -> PhaseListener:
        return self._get(self.names.phase_listener, PhaseListener)  # type: ignore[type-abstract]

    @property
    def pipes(self) -> dg.PipesSubprocessClient:
        return self._get(self.names.pipes_subprocess_client, dg.PipesSubprocessClient)


def api_key_vars(config: PipelineConfig) -> list[str]:
    """The variables the file's endpoints take their API keys from, in file order, once each."""
    return list(dict.fromkeys(e.api_key_env for e in config.inference.all_endpoints if e.api_key_env))


class ApiKeys(dg.ConfigurableResource):
    """API keys by the variable the pipeline file names for each (``api_key_env``). The Definitions
    set every value with ``dg.EnvVar(variable)``, which Dagster resolves when a run initializes the
    resource — nested in `inference`, so an unset variable fails that run (Dagster's error names the
    variable, never a value) and neither the code location's load nor the runs that don't send
    requests."""

    values: dict[str, str] = {}


class InferenceResource(dg.ConfigurableResource):
    """Where `responses` sends requests, with the settings of its `pipeline` resource. Leave
    `base_url` empty to use the file's inference section (the embedded server is then started on
    first use and stopped after the run; a managed server is started when it is not serving, and
    left running); set it to point the runs at an already running OpenAI-compatible server. API
    keys come from ``api_keys`` (:class:`ApiKeys`).

    With several inference hosts (`inference.hosts`), a run uses the host its tag `eagle3/host`
    names — its endpoints, and its health section for the preflight; a run without the tag (a
    backfill's) claims a free healthy host first (:func:`eagle3_pipeline.orchestration.hosts.claim_host`)."""

    pipeline: PipelineResource
    base_url: str | None = None
    model: str | None = None
    api_keys: ApiKeys
    _provider: InferenceProvider | None = PrivateAttr(default=None)
    _host: str | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        config = self.pipeline.config()
        if config.inference.hosts and not self.base_url:
            self._host = run_host(context.run)
            if self._host is None:
                instance, run_id, log = context.instance, context.run_id, context.log
                if instance is None or run_id is None or log is None:
                    raise RuntimeError(
                        "inference.hosts: a host is claimed for a run, and this resource was set up outside one "
                        "(no instance, run id or log); give it a base_url instead"
                    )
                self._host = claim_host(instance, run_id, config, log.info, self.pipeline.names())
            config = config.for_host(self._host)
        override = Endpoint(self.base_url, self.model or config.target.model) if self.base_url else None
        self._provider = InferenceProvider(config, override, api_keys=self.api_keys.values)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        """The run's embedded server stops; its tunnels to managed servers on an SSH host close."""
        if self._provider is not None:
            self._provider.close()
        TUNNELS.close()

    def _require(self) -> InferenceProvider:
        if self._provider is None:
            raise RuntimeError("InferenceResource used outside a run")
        return self._provider

    @property
    def host(self) -> str | None:
        """The inference host this run sends to (None: the single implicit host, or `base_url`)."""
        self._require()
        return self._host

    def endpoints(self, managed: ManagedGeneration | None = None) -> list[Endpoint]:
        """The endpoints after the preflight; with ``managed``, the managed server (if the pipeline has one)
        serves generation first (:class:`~eagle3_pipeline.inference.provider.InferenceProvider`)."""
        return self._require().endpoints(managed)

    @property
    def managed(self) -> bool:
        """Whether the runs send to a managed server (``serving.managed``, no ``base_url`` here)."""
        return self._require().setup is not None

    def recovery(self, managed: ManagedGeneration | None) -> ServerRecovery | None:
        """The generation engine's hook that brings the managed server back mid-run (None without one)."""
        return self._require().recovery(managed)

    @property
    def preflight_report(self) -> HealthReport | None:
        return self._require().preflight_report

    def tokenizer_name(self) -> str:
        return self._require().tokenizer_name()
