"""The root model of a pipeline file, and the run-time checks of what it names (source files, API keys)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from eagle3_pipeline.config.base import DATASET_ID_PATTERN, ConfigError, ConfigModel
from eagle3_pipeline.config.compute import ComputeConfig
from eagle3_pipeline.config.drafter import DrafterBenchmarkConfig, DrafterConfig, DrafterEvalConfig
from eagle3_pipeline.config.eagle3 import DraftVocabConfig, HiddenStatesConfig, TrainingDataConfig
from eagle3_pipeline.config.generation import DatasetConfig, FailoverConfig, GenerationConfig, PromptsConfig
from eagle3_pipeline.config.health import HealthConfig
from eagle3_pipeline.config.inference import EndpointConfig, InferenceConfig, TargetConfig
from eagle3_pipeline.config.machine import MachineConfig
from eagle3_pipeline.config.ops import AlertsConfig, DeployConfig, LaunchConfig, ScheduleConfig
from eagle3_pipeline.config.serving import (
    ServingConfig,
    check_managed_server,
    managed_base_url,
    provide_managed_defaults,
)


class PipelineConfig(ConfigModel):
    """One pipeline: its datasets, target model, inference backend and where outputs go."""

    name: Annotated[str, Field(pattern=DATASET_ID_PATTERN)] = Field(
        description="The pipeline's name: it scopes the default artifacts root, so two pipelines never share files."
    )
    artifacts_root: Path = Field(
        description=(
            "Where every phase writes (relative paths resolve against the pipeline file); default: <name> under "
            "$EAGLE3_ARTIFACTS_ROOT, else for a profile shipped in the package under the user's data folder "
            "($XDG_DATA_HOME/eagle3_pipeline, else ~/.local/share/eagle3_pipeline), else under artifacts/ beside "
            "the pipeline file; never the current directory."
        ),
    )
    seed: int = Field(default=0, description="Seeds the prompt sample, the train/eval split and the shuffles.")
    target: TargetConfig = Field(description="The target model (see its fields).")
    inference: InferenceConfig = Field(
        default=InferenceConfig(), description="Where the answers are generated (see its fields)."
    )
    serving: ServingConfig = Field(
        default=ServingConfig(),
        description=(
            "The inference server the pipeline runs itself on the health host, when managed (see its fields); with "
            "inference.hosts, the defaults each host's serving keys override."
        ),
    )
    generation: GenerationConfig = Field(
        default=GenerationConfig(), description="How the answers are generated (see its fields)."
    )
    prompts: PromptsConfig = Field(default=PromptsConfig(), description="How the prompts are read (see its fields).")
    training_data: TrainingDataConfig = Field(
        default=TrainingDataConfig(), description="How the answers become training rows (see its fields)."
    )
    health: HealthConfig = Field(
        default=HealthConfig(), description="The health gate before and during generation (see its fields)."
    )
    compute: ComputeConfig = Field(default=ComputeConfig(), description="Where the heavy phases run (see its fields).")
    draft_vocab: DraftVocabConfig = Field(
        default=DraftVocabConfig(), description="The drafter's vocabulary (see its fields)."
    )
    hidden_states: HiddenStatesConfig = Field(
        default=HiddenStatesConfig(), description="How the target's hidden states are extracted (see its fields)."
    )
    schedule: ScheduleConfig = Field(
        default=ScheduleConfig(), description="The scheduled backfill of responses (see its fields)."
    )
    launch: LaunchConfig = Field(
        default=LaunchConfig(), description="Relaunching failed generation runs (see its fields)."
    )
    drafter: DrafterConfig = Field(default=DrafterConfig(), description="Training of the drafter (see its fields).")
    drafter_eval: DrafterEvalConfig = Field(
        default=DrafterEvalConfig(), description="τ on the eval split and its check (see its fields)."
    )
    drafter_benchmark: DrafterBenchmarkConfig | None = Field(
        default=None,
        description="The online benchmark on the GPU host (see its fields); the asset exists only when this is set.",
    )
    deploy: DeployConfig = Field(
        default=DeployConfig(), description="The Dagster executor and the GPU pools (see its fields)."
    )
    alerts: AlertsConfig = Field(default=AlertsConfig(), description="Webhook notifications (see its fields).")
    machine: MachineConfig = Field(
        default=MachineConfig(),
        description="The GPU host as declared for the resource model (`plan`, the GPU phases' fit; see its fields).",
    )
    datasets: Annotated[list[DatasetConfig], Field(min_length=1)] = Field(
        description="The prompt sources, one partition each (see their fields)."
    )
    source_file: Path = Field(description="The pipeline file itself; set by the loader, never in the file.")

    @model_validator(mode="before")
    @classmethod
    def _managed_server_provides(cls, data: Any) -> Any:
        """A managed server's endpoint and health.server, where the file leaves them out."""
        return provide_managed_defaults(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _managed_servers_agree(self) -> PipelineConfig:
        if not self.serving.managed and not any(h.serving.managed for h in self.inference.hosts):
            return self
        if self.inference.kind != "endpoints":
            raise ValueError(
                "inference.kind: 'embedded' starts its own transformers server; a managed server (serving.managed) "
                "needs kind 'endpoints' (or leave inference.kind out)"
            )
        if not self.inference.hosts:
            check_managed_server(
                "serving",
                self.serving,
                endpoints=self.inference.endpoints,
                endpoints_where="inference.endpoints",
                health=self.health,
                health_where="health",
                target_model=self.target.model,
            )
            managed_url = managed_base_url(self.serving, self.health.model_dump())
            extracting = self.hidden_states.backend == "vllm" and self.serving.engine == "vllm"
            served = (self.hidden_states.vllm_base_url or "").rstrip("/") == managed_url
            if extracting and served and self.serving.api_key_env is not None:
                raise ValueError(
                    "serving.api_key_env: the managed vLLM server is also the extraction server "
                    "(hidden_states.backend vllm), which the extractor reaches on its own host's loopback without a "
                    "key; leave serving.api_key_env and bind_host out (it binds 127.0.0.1)"
                )
        for index, host in enumerate(self.inference.hosts):
            serving = host.effective_serving(self.serving)
            if not serving.managed:
                continue
            where = f"inference.hosts[{index}] (name {host.name!r})"
            health_where = f"{where}.health" if "server" in host.health.model_fields_set else "health"
            check_managed_server(
                f"{where}.serving",
                serving,
                endpoints=host.endpoints,
                endpoints_where=f"{where}.endpoints",
                health=host.effective_health(self.health),
                health_where=health_where,
                target_model=self.target.model,
            )
        return self

    @model_validator(mode="after")
    def _benchmark_target(self) -> PipelineConfig:
        benchmark = self.drafter_benchmark
        if benchmark is None or benchmark.target_model_path is not None:
            return self
        if not self.serving.managed and not any(
            h.effective_serving(self.serving).managed for h in self.inference.hosts
        ):
            raise ValueError(
                "drafter_benchmark.target_model_path: required without a managed server (serving.managed), whose "
                "serving.model it defaults to"
            )
        return self

    @field_validator("datasets")
    @classmethod
    def _unique_ids(cls, datasets: list[DatasetConfig]) -> list[DatasetConfig]:
        seen: set[str] = set()
        for ds in datasets:
            if ds.id in seen:
                raise ValueError(f"dataset id {ds.id!r} appears more than once; ids must be unique")
            seen.add(ds.id)
        return datasets

    @model_validator(mode="after")
    def _tokenizer_for_endpoints(self) -> PipelineConfig:
        if self.inference.kind == "endpoints" and not self.target.tokenizer:
            raise ValueError(
                "target.tokenizer is required when inference.kind is 'endpoints' "
                "(a Hugging Face id or a local folder with the target's tokenizer and chat template)"
            )
        return self

    @model_validator(mode="after")
    def _failover_backends(self) -> PipelineConfig:
        failover = self.generation.failover
        if failover is None:
            return self
        if self.inference.kind != "endpoints":
            raise ValueError(
                "generation.failover needs inference.kind 'endpoints' (it moves between inference.endpoints)"
            )
        if self.inference.hosts:
            raise ValueError(
                "generation.failover moves between inference.endpoints; with inference.hosts, a partition whose host "
                "turns sick moves to another healthy host instead, so set one or the other"
            )
        order = self.failover_order()
        models = {self.inference.endpoints[i].model or self.target.model for i in order}
        if len(models) > 1:
            raise ValueError(
                f"generation.failover.backends serve different models ({', '.join(sorted(models))}); a dataset's "
                f"answers "
                "must all come from one model, so every failover backend must serve the same one"
            )
        return self

    def failover_order(self) -> list[int]:
        """The indices into ``inference.endpoints`` of ``generation.failover.backends``, in order."""
        return failover_order(self.generation.failover, self.inference.endpoints)

    @model_validator(mode="after")
    def _rolling_extracts_with_our_phase(self) -> PipelineConfig:
        """Rolling windows are extracted by our `extract` phase; compute.kind command's extractor writes a
        whole store."""
        if isinstance(self.hidden_states.rolling_window_shards, int) and self.compute.kind == "command":
            raise ValueError(
                "hidden_states.rolling_window_shards: not supported with compute.kind 'command' (the user's extractor "
                "writes the "
                "whole store at once); use compute.kind local or ssh, or leave rolling_window_shards unset"
            )
        return self

    @model_validator(mode="after")
    def _hosts_serve_one_model(self) -> PipelineConfig:
        """A dataset's checkpoint is shared by every host, and its fingerprint names the model."""
        models = {
            host.name: sorted({e.model or self.target.model for e in host.endpoints}) for host in self.inference.hosts
        }
        if len({tuple(names) for names in models.values()}) > 1:
            shown = "; ".join(f"{name}: {', '.join(names)}" for name, names in models.items())
            raise ValueError(
                f"every one of inference.hosts must request the same model(s), since a partition may resume on any "
                f"host "
                f"from the same checkpoint (got {shown})"
            )
        return self

    def for_host(self, name: str | None) -> PipelineConfig:
        """This pipeline as one host of `inference.hosts` sees it: that host's endpoints, health and
        serving sections in place of the top-level ones (None: the first host). Without hosts: itself."""
        if not self.inference.hosts:
            if name is not None:
                raise ConfigError(
                    f"{self.source_file}: inference.hosts: not set, so there is no inference host {name!r}"
                )
            return self
        try:
            host = self.inference.host(name)
        except KeyError as exc:
            raise ConfigError(f"{self.source_file}: inference.hosts: {exc.args[0]}") from None
        inference = self.inference.model_copy(update={"endpoints": host.endpoints, "hosts": []})
        return self.model_copy(
            update={
                "inference": inference,
                "health": host.effective_health(self.health),
                "serving": host.effective_serving(self.serving),
            }
        )

    @property
    def dataset_ids(self) -> list[str]:
        return [ds.id for ds in self.datasets]

    def dataset(self, dataset_id: str) -> DatasetConfig:
        for ds in self.datasets:
            if ds.id == dataset_id:
                return ds
        raise KeyError(f"dataset {dataset_id!r} is not in {self.source_file}")

    def api_key(self, endpoint: EndpointConfig) -> str | None:
        """The endpoint's API key, read from its environment variable (ConfigError if unset)."""
        if not endpoint.api_key_env:
            return None
        check_secrets(self, only=[endpoint])
        return os.environ[endpoint.api_key_env]


def check_sources(config: PipelineConfig, only: list[DatasetConfig] | None = None) -> None:
    """Every (or each given) dataset's source file exists and is readable, else one ConfigError.

    A run-time check: the code location loads without the files (see :func:`check_runtime`)."""
    file = config.source_file
    for index, ds in enumerate(config.datasets):
        if ds.is_hub_dataset or (only is not None and ds not in only):
            continue
        path = Path(ds.source)
        where = f"datasets[{index}] (id {ds.id!r}).source"
        if not path.exists():
            raise ConfigError(f"{file}: {where}: file {str(path)!r} does not exist")
        if not path.is_file() or not os.access(path, os.R_OK):
            raise ConfigError(f"{file}: {where}: {str(path)!r} is not a readable file")


def check_secrets(config: PipelineConfig, only: list[EndpointConfig] | None = None) -> None:
    """Every (or each given) endpoint's `api_key_env` variable is set, else one ConfigError naming
    the variable (never its value). A run-time check, like :func:`check_sources`."""
    file = config.source_file
    listed = [(f"inference.endpoints[{i}]", e) for i, e in enumerate(config.inference.endpoints)]
    for h, host in enumerate(config.inference.hosts):
        listed += [
            (f"inference.hosts[{h}] (name {host.name!r}).endpoints[{i}]", e) for i, e in enumerate(host.endpoints)
        ]
    for where, endpoint in listed:
        if only is not None and endpoint not in only:
            continue
        var = endpoint.api_key_env
        if var and not os.environ.get(var):
            raise ConfigError(
                f"{file}: {where}.api_key_env: environment variable {var} "
                "is not set (expected it to hold the API key for this endpoint)"
            )


def check_runtime(config: PipelineConfig) -> None:
    """What a run needs from its environment: readable source files and set API-key variables."""
    check_sources(config)
    check_secrets(config)


def failover_order(failover: FailoverConfig | None, endpoints: Sequence[EndpointConfig]) -> list[int]:
    """The indices into ``endpoints`` (``inference.endpoints``) of ``failover.backends``, in order."""
    if failover is None:
        return []
    names = {e.name: i for i, e in enumerate(endpoints) if e.name}
    order: list[int] = []
    for ref in failover.backends:
        if isinstance(ref, int):
            if not 0 <= ref < len(endpoints):
                raise ValueError(
                    f"generation.failover.backends: index {ref} is not in inference.endpoints (0..{len(endpoints) - 1})"
                )
            index = ref
        elif ref in names:
            index = names[ref]
        else:
            raise ValueError(
                f"generation.failover.backends: {ref!r} names no entry of inference.endpoints (known names: "
                f"{sorted(names)})"
            )
        if index in order:
            raise ValueError(f"generation.failover.backends: {ref!r} is listed twice")
        order.append(index)
    return order
