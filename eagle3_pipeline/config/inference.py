"""`target:` and `inference:` the model the answers come from and the servers that produce them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from eagle3_pipeline.config.base import DATASET_ID_PATTERN, ENV_VAR_PATTERN, ConfigModel, HttpUrl
from eagle3_pipeline.config.health import SENSOR_ONLY_HEALTH_FIELDS, HealthConfig
from eagle3_pipeline.config.serving import ServingConfig

HOST_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"


class TargetConfig(ConfigModel):
    """The target model: the name the server knows it by and where its tokenizer lives."""

    model: Annotated[str, Field(min_length=1)] = Field(
        description="The name the server knows the target by (sent as the request's model), e.g. moonshotai/Kimi-K2.5."
    )
    tokenizer: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "A Hugging Face id or a local folder with the target's tokenizer and chat template (relative paths "
            "resolve against the pipeline file); required with inference.kind endpoints."
        ),
    )
    max_seq_len: Annotated[int, Field(gt=16)] = Field(
        default=2048,
        description=(
            "Longest conversation in tokens: a prompt whose estimate plus generation.max_tokens exceeds it is not "
            "sent, and longer training rows are dropped."
        ),
    )
    trust_remote_code: bool = Field(
        default=False,
        description=(
            "Run the Python code a target checkpoint ships (auto_map in its config.json or tokenizer_config.json), "
            "e.g. Kimi-K2.5's kimi_k25 model and TikToken tokenizer. Reaches every config, tokenizer and model "
            "load of every phase (eagle3_pipeline.target.folder); off, such a checkpoint is refused with an error "
            "naming this setting."
        ),
    )


class PriceConfig(ConfigModel):
    """What an endpoint charges per million tokens; used when its responses carry no cost field."""

    prompt_per_mtok: Annotated[float, Field(ge=0)] = Field(description="Price of a million prompt tokens, in USD.")
    completion_per_mtok: Annotated[float, Field(ge=0)] = Field(
        description="Price of a million completion tokens, in USD."
    )


class EndpointConfig(ConfigModel):
    """One OpenAI-compatible server the prompts are sent to (SGLang, vLLM, transformers serve or a hosted API)."""

    base_url: HttpUrl = Field(description="The server's OpenAI-compatible base URL, e.g. http://gpu-box:30000/v1.")
    name: Annotated[str, Field(pattern=DATASET_ID_PATTERN)] | None = Field(
        default=None,
        description="How the planner and generation.failover name this endpoint; default: its base URL.",
    )
    model: str | None = Field(default=None, description="The model name sent to this endpoint; default: target.model.")
    api_key_env: Annotated[str, Field(pattern=ENV_VAR_PATTERN)] | None = Field(
        default=None,
        description=(
            "The environment variable holding the endpoint's API key (sent as a bearer token, never logged); "
            "a run refuses to start while it is unset."
        ),
    )
    price: PriceConfig | None = Field(
        default=None, description="Its price, for cost accounting when a response carries no usage.cost."
    )


class EmbeddedServerConfig(ConfigModel):
    """The `transformers serve` process the embedded profile starts on this machine."""

    port: Annotated[int, Field(ge=0, le=65535)] = Field(default=0, description="Its port; 0: a free one.")
    startup_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=600.0, description="Seconds the server may take to answer its first request."
    )
    continuous_batching: bool = Field(default=True, description="Serve with transformers' continuous batching.")
    cb_num_blocks: Annotated[int, Field(gt=0)] = Field(
        default=512,
        description=(
            "The paged KV cache of continuous batching, in blocks of cb_block_size tokens. Left to itself, "
            "transformers serve reserves most of the machine's free RAM on a CPU (docs/measurements.md); "
            "512 × 32 tokens hold the embedded profile's 20 requests in flight."
        ),
    )
    cb_block_size: Annotated[int, Field(gt=0)] = Field(
        default=32, description="Tokens per block of the continuous-batching KV cache."
    )


class InferenceHostConfig(ConfigModel):
    """One inference host of several (`inference.hosts`): its endpoints, its health section and the
    pool its `responses` runs belong to. The host's `health` keys override the top-level `health`
    section for this host's checks (e.g. `host`, `server`, `expected_gpus`); what is not set there
    is taken from the top level."""

    name: Annotated[str, Field(pattern=HOST_NAME_PATTERN)] = Field(
        description="The host's name (unique): the eagle3/host run tag and the inference_server/<name> observations."
    )
    endpoints: Annotated[list[EndpointConfig], Field(min_length=1)] = Field(
        description="The host's endpoints (as inference.endpoints)."
    )
    health: HealthConfig = Field(
        default=HealthConfig(),
        description=(
            "Keys of the top-level health section to override for this host's checks (e.g. host, server, "
            "expected_gpus); every other key comes from the top level. Not sensor_interval_s or terminate_stalled_runs."
        ),
    )
    pool: Annotated[str, Field(pattern=r"^\S+$")] | None = Field(
        default=None, description="The pool (run tag eagle3/pool) of this host's responses runs; default: gpu-<name>."
    )
    serving: ServingConfig = Field(
        default=ServingConfig(),
        description=(
            "Keys of the top-level serving section to override for this host's managed server (e.g. port, "
            "tp_size, model); every other key comes from the top level."
        ),
    )

    @field_validator("health")
    @classmethod
    def _no_sensor_settings(cls, health: HealthConfig) -> HealthConfig:
        misplaced = [name for name in SENSOR_ONLY_HEALTH_FIELDS if name in health.model_fields_set]
        if misplaced:
            raise ValueError(
                f"{', '.join(misplaced)}: set in the top-level health section (one sensor watches every host)"
            )
        return health

    @property
    def pool_name(self) -> str:
        return self.pool or f"gpu-{self.name}"

    def effective_health(self, defaults: HealthConfig) -> HealthConfig:
        """The top-level health section with this host's keys in place of its own."""
        return defaults.model_copy(update={name: getattr(self.health, name) for name in self.health.model_fields_set})

    def effective_serving(self, defaults: ServingConfig) -> ServingConfig:
        """The top-level serving section with this host's keys in place of its own."""
        return defaults.effective(self.serving)


class InferenceConfig(ConfigModel):
    """Where the answers are generated: the embedded server on this machine, or endpoints on one or several hosts."""

    kind: Literal["embedded", "endpoints"] = Field(
        default="embedded",
        description="embedded: start transformers serve on this machine; endpoints: send to the servers listed.",
    )
    embedded: EmbeddedServerConfig = Field(
        default=EmbeddedServerConfig(), description="The embedded server (kind embedded; see its fields)."
    )
    endpoints: list[EndpointConfig] = Field(
        default=[],
        description=(
            "The endpoints of one inference host (kind endpoints): each request goes to the one with the fewest "
            "requests outstanding."
        ),
    )
    hosts: list[InferenceHostConfig] = Field(
        default=[],
        description=(
            "Several inference hosts (kind endpoints), instead of endpoints: partitions are spread over the "
            "healthy ones. Every host must request the same model."
        ),
    )

    @model_validator(mode="after")
    def _endpoints_match_kind(self) -> InferenceConfig:
        if self.hosts:
            if self.kind != "endpoints":
                raise ValueError("inference.hosts needs kind 'endpoints'")
            if self.endpoints:
                raise ValueError("list the endpoints under each of inference.hosts, not in inference.endpoints too")
            names = [host.name for host in self.hosts]
            repeated = sorted({name for name in names if names.count(name) > 1})
            if repeated:
                raise ValueError(
                    f"host name(s) {repeated} appear more than once in inference.hosts; names must be unique"
                )
        elif self.kind == "endpoints" and not self.endpoints:
            raise ValueError("kind 'endpoints' needs at least one entry in inference.endpoints (or inference.hosts)")
        names = [e.name for e in self.endpoints if e.name]
        if len(names) != len(set(names)):
            raise ValueError(f"inference.endpoints: names must be unique (got {names})")
        return self

    @property
    def all_endpoints(self) -> list[EndpointConfig]:
        """Every endpoint: the single host's, or those of every one of several hosts."""
        return [*self.endpoints, *(e for host in self.hosts for e in host.endpoints)]

    def host(self, name: str | None) -> InferenceHostConfig:
        """The host called `name` (None: the first listed); KeyError naming the hosts if unknown."""
        if name is None:
            return self.hosts[0]
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no inference host {name!r}; inference.hosts names {', '.join(h.name for h in self.hosts)}")
