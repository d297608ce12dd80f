"""The pipeline file (YAML) → validated, typed models.

Every problem with a pipeline file is reported as one :class:`ConfigError` that names the file,
the field path, the bad value and what was expected. Secrets are never echoed: a field that names
an environment variable holding an API key is reported by the variable's *name* only.
"""

from __future__ import annotations

import os
import re
import string
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

DATASET_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
ENV_VAR_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
CONFIG_ENV_VAR = "EAGLE3_CONFIG"
ARTIFACTS_ENV_VAR = "EAGLE3_ARTIFACTS_ROOT"
LOCAL_PROFILE = "local"


class ConfigError(ValueError):
    """A pipeline file is unusable; the message says where and what was expected."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DatasetConfig(_Model):
    id: Annotated[str, Field(pattern=DATASET_ID_PATTERN)]
    source: Annotated[str, Field(min_length=1)]
    format: Literal["auto", "sharegpt", "openai"] = "auto"
    sample_size: Annotated[int, Field(gt=0)] | None = None
    # Tokens this dataset may generate (counted as `generation.budget_counts` says). Dispatching
    # stops once they are reached; the overshoot is at most what the requests in flight can add.
    token_budget: Annotated[int, Field(gt=0)] | None = None
    split: str = "train"

    @property
    def is_hub_dataset(self) -> bool:
        return self.source.startswith("hf:")


class TargetConfig(_Model):
    """The target model: the name the server knows it by and where its tokenizer lives."""

    model: Annotated[str, Field(min_length=1)]
    tokenizer: Annotated[str, Field(min_length=1)] | None = None
    max_seq_len: Annotated[int, Field(gt=16)] = 2048
    trust_remote_code: bool = Field(
        default=False,
        description=(
            "Run the Python code a target checkpoint ships (auto_map in its config.json or tokenizer_config.json), "
            "e.g. Kimi-K2.5's kimi_k25 model and TikToken tokenizer. Reaches every config, tokenizer and model "
            "load of every phase (eagle3_pipeline.target); off, such a checkpoint is refused with an error naming "
            "this setting."
        ),
    )


class PriceConfig(_Model):
    """What an endpoint charges per million tokens; used when its responses carry no cost field."""

    prompt_per_mtok: Annotated[float, Field(ge=0)]
    completion_per_mtok: Annotated[float, Field(ge=0)]


class EndpointConfig(_Model):
    base_url: Annotated[str, Field(pattern=r"^https?://")]
    # How the planner and `generation.failover` name this endpoint (default: its base URL).
    name: Annotated[str, Field(pattern=DATASET_ID_PATTERN)] | None = None
    model: str | None = None
    api_key_env: Annotated[str, Field(pattern=ENV_VAR_PATTERN)] | None = None
    price: PriceConfig | None = None


class EmbeddedServerConfig(_Model):
    port: Annotated[int, Field(ge=0, le=65535)] = 0
    startup_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    continuous_batching: bool = True
    # The paged KV cache of continuous batching, in blocks of cb_block_size tokens. Left to itself,
    # `transformers serve` reserves most of the machine's free RAM on a CPU (~14 GB measured here);
    # 512 × 32 tokens hold the embedded profile's 20 requests in flight in about 1 GB.
    cb_num_blocks: Annotated[int, Field(gt=0)] = 512
    cb_block_size: Annotated[int, Field(gt=0)] = 32


class ConcurrencyConfig(_Model):
    """Requests in flight at once per prompt length class, across all endpoints together."""

    short: Annotated[int, Field(gt=0, le=4096)] = 150
    long: Annotated[int, Field(gt=0, le=4096)] = 32

    @property
    def total(self) -> int:
        return self.short + self.long


class RetryConfig(_Model):
    """Bounded, jittered exponential backoff for connection errors, timeouts, 408, 429 and 5xx."""

    max_attempts: Annotated[int, Field(gt=0, le=100)] = 6
    backoff_initial_s: Annotated[float, Field(gt=0)] = 1.0
    backoff_max_s: Annotated[float, Field(gt=0)] = 60.0


class FailoverConfig(_Model):
    """Generate on one backend at a time, in this order (``inference.endpoints`` names or indices),
    and move a dataset to the next one when its ETA on the current one passes the deadline or the
    current one turns unhealthy (``unhealthy_after_errors`` failed attempts in a row; with
    ``probe_timeout_s``, a backend that delivered no answer during a check while requests were in
    flight is sent a 1-token request, and a probe not answered in time counts as a failed attempt)."""

    backends: Annotated[list[str | int], Field(min_length=2)]
    deadline_s: Annotated[float, Field(gt=0)] | None = None  # from the start of the dataset's run
    deadline: AwareDatetime | None = None  # an absolute time (ISO 8601 with a UTC offset)
    check_every_s: Annotated[float, Field(gt=0)] = 30.0
    unhealthy_after_errors: Annotated[int, Field(gt=0)] = 5
    probe_timeout_s: Annotated[float, Field(gt=0)] | None = None

    @model_validator(mode="after")
    def _one_deadline(self) -> FailoverConfig:
        if self.deadline_s is not None and self.deadline is not None:
            raise ValueError("set deadline_s (seconds from the run's start) or deadline (an ISO time), not both")
        return self


class GenerationConfig(_Model):
    max_tokens: Annotated[int, Field(gt=0)] = 256
    temperature: Annotated[float, Field(ge=0)] = 0.0
    concurrency: ConcurrencyConfig = ConcurrencyConfig()
    connect_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    read_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    retry: RetryConfig = RetryConfig()
    max_consecutive_errors: Annotated[int, Field(gt=0)] = 25
    max_failed_fraction: Annotated[float, Field(ge=0, le=1)] = 0.0
    budget_counts: Literal["completion", "prompt_and_completion"] = "completion"
    fsync: Literal["never", "interval", "always"] = "interval"
    fsync_interval_s: Annotated[float, Field(gt=0)] = 1.0
    reasoning: Literal["keep", "strip"] = "keep"
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description=(
            "Sent with every request as chat_template_kwargs (SGLang and vLLM pass them to the chat template; e.g. "
            "{thinking: false} turns Kimi-K2.5's thinking off). training_data renders with the same kwargs, so the "
            "rows hold the prompt as the server rendered it. Part of the generation fingerprint when set."
        ),
    )
    regenerate_turns: Literal["last", "all"] = "last"
    progress_interval_s: Annotated[float, Field(gt=0)] = 30.0
    # What a run does when the checkpoint was made under another generation fingerprint (model,
    # max_tokens, temperature, ...): refuse before sending anything, or keep the old answers aside
    # (moved under responses/previous/) and regenerate the partition.
    on_fingerprint_change: Literal["refuse", "new_version"] = "refuse"
    # How a prompt's length is estimated before it is sent (prompt + max_tokens must fit
    # target.max_seq_len): the target's chat template and tokenizer, or 4 characters a token.
    length_estimator: Literal["tokenizer", "chars"] = "tokenizer"
    # The share of a dataset's prompts whose answer may stay empty (no content after the reasoning
    # is split off, no tool calls) once every attempt is spent; the responses:empty_answers check.
    max_empty_rate: Annotated[float, Field(ge=0, le=1)] = 0.02
    failover: FailoverConfig | None = None

    @field_validator("concurrency", mode="before")
    @classmethod
    def _one_number_for_both_classes(cls, value: Any) -> Any:
        return value if isinstance(value, (dict, ConcurrencyConfig)) else {"short": value, "long": value}


class PromptsConfig(_Model):
    long_threshold_tokens: Annotated[int, Field(gt=0)] = 512
    max_bad_records_listed: Annotated[int, Field(gt=0)] = 5


class TrainingDataConfig(_Model):
    """How responses become training shards (see eagle3_pipeline.dataprep).

    ``reasoning``: see its field description. ``max_template_mismatch_rate``: the share
    of conversations whose generated turns the template cannot render faithfully (the blocking check
    ``training_data:template_mismatch_rate`` fails above it). ``buffer_rows``: conversations tokenized
    per batch and held per sort bucket, which bounds memory whatever the number of rows."""

    eval_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.05
    shard_rows: Annotated[int, Field(gt=0)] = 10_000
    reasoning: Literal["emit", "render", "drop"] = Field(
        default="emit",
        description=(
            "emit: the response is the prompt as the server rendered it for generation followed by what the target "
            "emitted (its reasoning in its own thinking markup, content, tool calls, end of turn), masked; render: the "
            "template's history render of the turn (Kimi-K2.5's blanks the reasoning); drop: reasoning left out."
        ),
    )
    max_template_mismatch_rate: Annotated[float, Field(ge=0, le=1)] = 0.01
    tokenizer_check_samples: Annotated[int, Field(ge=0)] = Field(
        default=8,
        description=(
            "Before the rows are built, this many rendered conversations are tokenized locally and by the first "
            "serving endpoint with a tokenize route (SGLang and vLLM: POST /tokenize); a disagreement fails the phase "
            "with the first differing token. No endpoint to ask: recorded as not checked. 0: off."
        ),
    )
    buffer_rows: Annotated[int, Field(gt=0)] = 4096
    held_out_per_dataset: Annotated[int, Field(ge=0)] = Field(
        default=0,
        description=(
            "Per dataset, this many samples (the smallest sha256('held_out:{seed}:{id}'), at most half the dataset's rows) are "
            "forced into the eval split, never trained on, and recorded in training_data's manifest.json (held_out); "
            "drafter_eval reports τ on them apart. The same ids every run for the same prompts and seed. 0: none."
        ),
    )


class HostConfig(_Model):
    """Where the health probes run: this machine, or the GPU box over SSH (host key verified).

    An encrypted `key_file` is decrypted with the passphrase in the environment variable named by
    `key_passphrase_env` (read when connecting, never logged). The SSH agent is offered too unless
    `allow_agent` is false.
    """

    kind: Literal["local", "ssh"] = "local"
    hostname: str | None = None
    port: Annotated[int, Field(gt=0, le=65535)] = 22
    username: str | None = None
    key_file: str | None = None
    key_passphrase_env: Annotated[str, Field(pattern=ENV_VAR_PATTERN)] | None = None
    allow_agent: bool = True
    known_hosts: str = "~/.ssh/known_hosts"
    trust_on_first_use: bool = False
    connect_timeout_s: Annotated[float, Field(gt=0)] = 10.0

    @model_validator(mode="after")
    def _ssh_needs_a_hostname(self) -> HostConfig:
        if self.kind == "ssh" and not self.hostname:
            raise ValueError("kind 'ssh' needs health.host.hostname")
        if self.key_passphrase_env and not self.key_file:
            raise ValueError("key_passphrase_env needs health.host.key_file (the encrypted key it unlocks)")
        return self


class MonitoredServerConfig(_Model):
    """The inference server the health checks watch (for the embedded profile: leave it out)."""

    kind: Literal["sglang", "vllm", "transformers", "custom"] = "sglang"
    port: Annotated[int, Field(gt=0, le=65535)]
    base_url: Annotated[str, Field(pattern=r"^https?://")] | None = None
    tp_size: Annotated[int, Field(gt=0)] = 1
    process_pattern: str = ""
    generation_probe: Literal["chat", "health_generate"] = "chat"
    log_path: Annotated[str, Field(pattern=r"^/")] | None = None


CheckName = Literal["server_process", "port", "generation", "throughput", "gpus", "disk", "host_memory", "progress"]


class HealthConfig(_Model):
    host: HostConfig = HostConfig()
    server: MonitoredServerConfig | None = None
    expected_gpus: Annotated[int, Field(ge=0)] = 0
    min_disk_free_gb: Annotated[float, Field(ge=0)] = 5.0
    min_mem_free_gb: Annotated[float, Field(ge=0)] = 1.0
    watch_dir: Annotated[str, Field(pattern=r"^/")] | None = None
    stall_window_s: Annotated[float, Field(gt=0)] = 600.0
    shell_section_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    generation_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    tick_timeout_s: Annotated[float, Field(gt=0, le=50)] = 15.0
    # Hosted endpoints (with api_key_env) get a real completion at most this often; their last
    # verdict is reused, with its age, in between.
    hosted_probe_interval_s: Annotated[float, Field(gt=0)] = 300.0
    kernel_log_path: Annotated[str, Field(pattern=r"^/")] = "/var/log/kern.log"
    optional_checks: list[CheckName] = []
    sensor_interval_s: Annotated[int, Field(ge=5)] = 30
    terminate_stalled_runs: bool = False
    max_truncation_rate: Annotated[float, Field(ge=0, le=1)] = 0.5


# Settings of the one health sensor, so they stay in the top-level `health` section.
SENSOR_ONLY_HEALTH_FIELDS = ("sensor_interval_s", "terminate_stalled_runs")
HOST_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"


class InferenceHostConfig(_Model):
    """One inference host of several (`inference.hosts`): its endpoints, its health section and the
    pool its `responses` runs belong to. The host's `health` keys override the top-level `health`
    section for this host's checks (e.g. `host`, `server`, `expected_gpus`); what is not set there
    is taken from the top level."""

    name: Annotated[str, Field(pattern=HOST_NAME_PATTERN)]
    endpoints: Annotated[list[EndpointConfig], Field(min_length=1)]
    health: HealthConfig = HealthConfig()
    pool: Annotated[str, Field(pattern=r"^\S+$")] | None = None

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


class InferenceConfig(_Model):
    kind: Literal["embedded", "endpoints"] = "embedded"
    embedded: EmbeddedServerConfig = EmbeddedServerConfig()
    endpoints: list[EndpointConfig] = []
    # Several inference hosts (kind 'endpoints'): partitions are spread over the healthy ones.
    hosts: list[InferenceHostConfig] = []

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


# -- compute: where the heavy phases (hidden_states, drafter) run -------------------------------

COMMAND_PLACEHOLDERS = ("output_dir", "run_dir", "workdir", "artifacts_root", "python", "spec")


class ComputeConfig(_Model):
    """Where a heavy phase runs: ``local`` (in process), ``ssh`` (this project's worker on the GPU
    host as a Dagster Pipes process) or ``command`` (for extraction only, a user command on the GPU
    host, e.g. SpecForge's ``prepare_hidden_states.py``, whose output is imported into our store
    there; the other phases then run the worker on that host as for ``ssh``).

    ``host`` has the shape of ``health.host`` (``kind`` defaults to ``ssh`` here). ``workdir``
    holds one folder per run (spec, Pipes messages, pid, exit status, logs); outputs go under
    ``artifacts_root`` on the host, which mirrors the local artifacts root. ``command`` is a
    template: ``{output_dir}``, ``{run_dir}``, ``{workdir}``, ``{artifacts_root}``, ``{python}``
    and ``{spec}`` are replaced by shell-quoted values. ``gpus`` GPUs must be free (memory used
    below ``gpu_free_memory_mib``) before a phase starts. A connection silent for
    ``heartbeat_timeout_s`` (the host sends a heartbeat about every second) counts as dropped.
    """

    kind: Literal["local", "ssh", "command"] = "local"
    host: HostConfig = HostConfig()
    python: Annotated[str, Field(min_length=1)] = "python3"
    workdir: Annotated[str, Field(pattern=r"^/")] | None = None
    artifacts_root: Annotated[str, Field(pattern=r"^/")] | None = None
    command: Annotated[str, Field(min_length=1)] | None = None
    gpus: Annotated[int, Field(ge=0)] = 0
    gpu_free_memory_mib: Annotated[float, Field(ge=0)] = 1024.0
    kill_grace_s: Annotated[float, Field(gt=0)] = 10.0
    reconnect_timeout_s: Annotated[float, Field(ge=0)] = 60.0
    heartbeat_timeout_s: Annotated[float, Field(ge=5)] = 30.0

    @field_validator("host", mode="before")
    @classmethod
    def _host_defaults_to_ssh(cls, value: Any) -> Any:
        return {"kind": "ssh", **value} if isinstance(value, dict) else value

    @field_validator("command")
    @classmethod
    def _known_placeholders(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            names = [name for _, name, _, _ in string.Formatter().parse(value) if name is not None]
        except ValueError as exc:
            raise ValueError(f"not a valid command template ({exc}); write literal braces as {{{{ and }}}}") from None
        unknown = sorted(set(names) - set(COMMAND_PLACEHOLDERS))
        if unknown:
            raise ValueError(f"unknown placeholder(s) {unknown}; allowed: {', '.join(COMMAND_PLACEHOLDERS)}")
        return value

    @model_validator(mode="after")
    def _remote_needs_host_and_dirs(self) -> ComputeConfig:
        if self.kind == "local":
            return self
        if self.host.kind != "ssh":
            raise ValueError(f"kind {self.kind!r} needs compute.host with a hostname (an SSH host)")
        missing = [name for name in ("workdir", "artifacts_root") if getattr(self, name) is None]
        if missing:
            raise ValueError(
                f"kind {self.kind!r} needs compute.{' and compute.'.join(missing)} (absolute paths on the host)"
            )
        if self.kind == "command" and self.command is None:
            raise ValueError(
                "kind 'command' needs compute.command (the command that writes SpecForge files to {output_dir})"
            )
        return self


# --- EAGLE-3 phase A: draft vocabulary and hidden states (issue 9) -------------------------------


class DraftVocabConfig(_Model):
    """`draft_vocab:` the target ids the drafter predicts, chosen by masked-token frequency."""

    # Default: a quarter of the target vocabulary, at least 1024 (draft_vocab.default_draft_vocab_size).
    size: Annotated[int, Field(gt=0)] | None = None
    # Rows of the target's lm_head; default: training_data's vocab_size (the tokenizer's length).
    # Set it when the target pads its embedding matrix beyond the tokenizer.
    target_vocab_size: Annotated[int, Field(gt=0)] | None = None
    # The asset check `draft_vocab:coverage` fails below this share of masked train tokens.
    min_coverage: Annotated[float, Field(ge=0, le=1)] = 0.9


class ServingValidationConfig(_Model):
    """`hidden_states.validation:` the states checked against the serving target before a large extraction."""

    samples: Annotated[int, Field(ge=0)] = Field(
        default=8,
        description=(
            "How many training_data samples (the ones with the smallest SHA-256 of their id) the serving server is asked "
            "about while it is up (training_data time, or the hidden_states preflight): per position its greedy next token "
            "and, where it gives logprobs, the top-2 margin; plus its own tokenization of the sample's text. The extract "
            "phase computes the same samples through its state source first and compares argmax(lm_head(teacher)) with "
            "the server's token before the large extraction starts. 0: off (the serving_agreement check then reports "
            "'not validated')."
        ),
    )
    min_agreement: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.9,
        description=(
            "Share of the compared positions (near-ties left out) where argmax(lm_head(teacher)) must equal the server's "
            "greedy token; below it the extract phase refuses to start and names the samples and positions."
        ),
    )
    near_tie_logprob_margin: Annotated[float, Field(ge=0)] = Field(
        default=0.2,
        description=(
            "A position whose server top-1 and top-2 logprobs differ by less than this (nats) is a near-tie: numerics "
            "(bf16 states, the server's kernels and quantization) may flip it, so it is reported apart and not counted in "
            "the agreement. Unknown where the server gives no logprobs (the embedded server)."
        ),
    )
    max_positions: Annotated[int, Field(gt=0)] = Field(
        default=256,
        description="Positions compared per sample (the first ones) where the server answers every position in one request (SGLang, vLLM).",
    )
    text_positions: Annotated[int, Field(gt=0)] = Field(
        default=16,
        description=(
            "Positions compared per sample against a server that only completes text (the embedded transformers "
            "serve): one greedy 1-token completion of the decoded prefix each, so fewer."
        ),
    )
    timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=120.0, description="Timeout of each request to the serving server."
    )


class HiddenStatesConfig(_Model):
    """`hidden_states:` how the target's states are extracted (the `extract` phase's settings)."""

    # The target's weights as transformers loads them (a folder or a Hugging Face id, on the machine
    # where extraction runs). Default: the embedded model, or target.tokenizer for endpoints.
    model: str | None = None
    # Output-of-layer ids (shared/EAGLE3.md §3); default [1, N/2-1, N-4] for an N-layer target.
    aux_layer_ids: list[int] | None = None
    shard_tokens: Annotated[int, Field(gt=0)] = 32768
    batch_tokens: Annotated[int, Field(gt=0)] = 8192
    max_batch_size: Annotated[int, Field(gt=0)] = 32
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Refuse to start when free disk < estimated bytes × disk_margin.
    disk_margin: Annotated[float, Field(gt=0)] = 1.2
    # Replace a store made under other settings instead of refusing.
    overwrite: bool = False
    spot_check_samples: Annotated[int, Field(ge=0)] = 4
    # Largest relative L2 error (per sample and tensor, bf16) between stored and re-computed states.
    spot_check_tolerance: Annotated[float, Field(gt=0)] = 0.01
    storage_dtype: Literal["bfloat16", "float8_e4m3"] = Field(
        default="bfloat16",
        description=(
            "How the store holds the aux layers and the teacher. bfloat16: 2 bytes per value ((3+1)·H·2 + 5 bytes per token; "
            "Kimi-K2.5: 57,349). float8_e4m3: 1 byte per value plus a float32 scale per token and layer ((3+1)·(H+4) + 5; "
            "Kimi-K2.5: 28,693), about half the disk; every reader dequantizes to bf16 (eagle3_pipeline.hidden_states.store). "
            "Part of the store's identity: a store of the other dtype is refused (or replaced with overwrite), never reused. "
            "The spot check compares the stored states with the re-computed ones rounded the same way."
        ),
    )
    backend: Literal["transformers", "sglang", "vllm"] = Field(
        default="transformers",
        description=(
            "What computes the states. transformers: the target in this process (or in the worker on the GPU host) with "
            "transformers, device_map across the visible GPUs. sglang: SGLang's own model runner in process, with tensor "
            "parallelism (tp_size ranks under torchrun, started with sglang_python), fed our input_ids, aux layers captured "
            "through SGLang's EAGLE-3 switch (set_eagle3_layers_to_capture): for a target only SGLang can hold (Kimi-K2.5 "
            "INT4 at tp 8). The worker is written against sglang 0.5.14 (eagle3_pipeline.hidden_states.sglang_capture) "
            "and refuses another version. Stop the inference server first: the phase needs the GPUs it holds. vllm: a vLLM "
            "server already started with the extract_hidden_states speculative method and its ExampleHiddenStatesConnector "
            "(vllm_base_url, vllm_output_dir; eagle3_pipeline.hidden_states.vllm_capture); the phase sends it our input_ids."
        ),
    )
    vllm_base_url: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "backend vllm: the OpenAI-compatible base URL (…/v1) of a vLLM server already started with "
            "--speculative-config method extract_hidden_states (the aux layers' ids + 1 and num_hidden_layers), the "
            "ExampleHiddenStatesConnector as --kv-transfer-config and --no-enable-chunked-prefill, as reachable from where "
            "extraction runs. Required with backend vllm."
        ),
    )
    vllm_output_dir: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "backend vllm: the folder the connector writes to (its shared_storage_path), as seen on the machine where "
            "extraction runs; each request's file is read there and deleted once read. Required with backend vllm."
        ),
    )
    sglang_python: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "backend sglang: the python of the SGLang venv where extraction runs (the GPU host for compute ssh/command, "
            "this machine for compute local), with sglang==0.5.14 and this package installed (e.g. /opt/sglang/.venv/bin/python). "
            "Required with backend sglang."
        ),
    )
    tp_size: Annotated[int, Field(ge=1)] = Field(
        default=8,
        description=(
            "backend sglang: tensor-parallel ranks (GPUs, one torchrun process each); 8 as the target is served "
            "(Kimi-K2.5: --tp-size 8). With compute ssh/command that many GPUs must be free on the host."
        ),
    )
    mem_fraction_static: Annotated[float, Field(gt=0, lt=1)] = Field(
        default=0.75,
        description=(
            "backend sglang: share of each GPU's memory for weights and the KV pool (SGLang's --mem-fraction-static); "
            "0.75 as SpecForge's DeepSeek-V3 hidden-state recipe. The KV pool bounds batch_tokens."
        ),
    )
    rolling_window_shards: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "Rolling mode, for a store larger than the disk (null: off, the whole store is extracted once). With N, "
            "hidden_states extracts only the eval shards (drafter_eval reads them) and records the train shards' layout; "
            "eagle3_drafter then, per epoch and per window of N train shards (shard_tokens each): extracts the window, "
            "trains on its rows, checkpoints, records the window done (<drafter run>/rolling.json) and deletes it. Disk "
            "peak: the eval shards + one window. Each epoch re-extracts every train token: extraction time × drafter.epochs "
            "and one target load per window: pick the largest N the disk holds (benchmarks/rolling_tradeoff.py prints the figures). "
            "compute.kind command is not supported."
        ),
    )
    validation: ServingValidationConfig = Field(
        default_factory=ServingValidationConfig,
        description="The check of the states against the serving target before a large extraction (see its fields).",
    )

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_increasing_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and (len(ids) != 3 or ids != sorted(set(ids)) or ids[0] < 0):
            raise ValueError(f"expected 3 increasing non-negative layer ids, got {ids}")
        return ids

    @model_validator(mode="after")
    def _vllm_settings(self) -> HiddenStatesConfig:
        if self.backend == "vllm" and (self.vllm_base_url is None or self.vllm_output_dir is None):
            raise ValueError(
                "backend 'vllm' needs hidden_states.vllm_base_url (the …/v1 URL of a vLLM server started with "
                "extract_hidden_states) and hidden_states.vllm_output_dir (its connector's shared_storage_path, as seen here)"
            )
        return self

    @model_validator(mode="after")
    def _sglang_settings(self) -> HiddenStatesConfig:
        if self.backend != "sglang":
            return self
        if self.sglang_python is None:
            raise ValueError(
                "backend 'sglang' needs hidden_states.sglang_python: the python of the venv with sglang==0.5.14 and this "
                "package, on the machine where extraction runs"
            )
        if self.device == "cpu":
            raise ValueError(
                "device 'cpu' is for backend 'transformers'; backend 'sglang' runs on the GPUs (device: auto or cuda)"
            )
        return self


CRON_PATTERN = r"^(@(yearly|annually|monthly|weekly|daily|midnight|hourly)|\S+( \S+){4})$"


class ScheduleConfig(_Model):
    """The scheduled backfill of missing or stale `responses` partitions: off unless `cron` is set."""

    cron: Annotated[str, Field(pattern=CRON_PATTERN)] | None = None
    timezone: str = "UTC"


class LaunchConfig(_Model):
    """How the scheduled backfill and the health sensor relaunch a partition whose generation runs failed:
    attempt k+1 waits backoff_initial_s × 2^(k-1) (at most backoff_max_s) after failure k; after
    max_attempts consecutive failures the partition is left alone until a run succeeds."""

    max_attempts: Annotated[int, Field(gt=0, le=100)] = 3
    backoff_initial_s: Annotated[float, Field(ge=0)] = 600.0
    backoff_max_s: Annotated[float, Field(ge=0)] = 21600.0
    # With several inference hosts: how long a generation run without a host tag (a backfill's) waits
    # for a free healthy host before it fails, and how often it looks.
    host_wait_s: Annotated[float, Field(ge=0)] = 3600.0
    host_poll_s: Annotated[float, Field(gt=0)] = 5.0


class DrafterModelConfig(_Model):
    """Draft model dimensions and RoPE; each left out takes its default: the target's value, except the
    attention/MLP shape for an MLA target (Kimi, DeepSeek-V3), which follows the published DeepSeek-V3
    drafter (`eagle3_pipeline.drafter.train.drafter_config`)."""

    hidden_size: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Draft hidden size; default the target's."
    )
    intermediate_size: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description="MLP width; default the target's, for an MLA target 40960/7168 of the draft hidden size.",
    )
    num_attention_heads: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Query heads; default the target's, for an MLA target hidden_size // head_dim."
    )
    num_key_value_heads: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="KV heads (must divide the query heads); default the target's, for an MLA target 8."
    )
    head_dim: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Per-head size; default the target's, for an MLA target 128."
    )
    rope_theta: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="RoPE base; default the target's."
    )
    rope_scaling: dict[str, Any] | None = Field(
        default=None,
        description=(
            "RoPE scaling in the Hugging Face form (rope_type default, linear, llama3 or yarn and its keys); "
            "left out: the target's; null: no scaling. YaRN is written so SGLang and vLLM serve it as trained "
            "(attention factor 0.1·ln(factor) + 1; mscale other than 1 and attn_factor/attention_factor are refused)."
        ),
    )
    max_position_embeddings: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Context the drafter's config.json declares; default the target's, never less."
    )

    @field_validator("rope_scaling", mode="before")
    @classmethod
    def _null_means_no_scaling(cls, value: Any) -> Any:
        # An explicit null must survive `model_dump(exclude_none=True)` (the train spec): it becomes the
        # scaling that means none, where a left-out key stays unset and takes the target's.
        return {"rope_type": "default"} if value is None else value


class DrafterConfig(_Model):
    """Training of the EAGLE-3 drafter (the `eagle3_drafter` asset)."""

    model: DrafterModelConfig = DrafterModelConfig()
    ttt_steps: Annotated[int, Field(gt=0, le=16)] = 7
    lr: Annotated[float, Field(gt=0)] = Field(
        default=1e-4,
        description=(
            "Peak AdamW learning rate (linear warmup, then cosine). 1e-4: SpecForge's EAGLE-3 recipes for Llama-3.1-8B, "
            "Llama-3.3-70B and Kimi-K2 (sgl-project/SpecForge examples/configs/llama3.1-8b-eagle3-online.yaml @ 1d62d19, "
            "llama3.3-70b-eagle3-online.yaml @ 2a17d42, examples/run_kimi_k2_eagle3_online.sh @ 03ebe2c: batch 1 per GPU on 8 "
            "GPUs at max_length 2048-4096, about this pipeline's batch_tokens a step); its DeepSeek-V3 recipe takes 5e-5 "
            "(examples/configs/deepseek-v3-671b-eagle3-online.yaml @ ae91f5b), as does EAGLE's own EAGLE-3 training "
            "(SafeAILab/EAGLE eagle/traineagle3/ds_config.json @ 9666a81: WarmupDecayLR to 5e-5)."
        ),
    )
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.02
    epochs: Annotated[int, Field(gt=0)] = Field(
        default=10,
        description=(
            "Passes over the train split. 10: SpecForge's EAGLE-3 recipes for Llama-3.1-8B, Llama-3.3-70B, DeepSeek-V3 671B "
            "and Kimi-K2 all train num_epochs 10 (the files named under lr); EAGLE's own EAGLE-3 training runs 40 "
            "(SafeAILab/EAGLE eagle/traineagle3/main.py @ 82bd2df, num_epochs). A small CPU profile sets its own (profiles/local.yaml)."
        ),
    )
    max_steps: Annotated[int, Field(gt=0)] | None = None
    batch_tokens: Annotated[int, Field(gt=0)] = 16384
    max_seq_len: Annotated[int, Field(gt=2)] | None = None  # None: target.max_seq_len
    grad_clip: Annotated[float, Field(gt=0)] = 0.5
    checkpoint_every: Annotated[int, Field(gt=0)] = 500
    keep_checkpoints: Annotated[int, Field(gt=0)] = 2
    eval_samples: Annotated[int, Field(ge=0)] = 256
    log_every: Annotated[int, Field(gt=0)] = 10
    seed: int | None = None  # None: the pipeline seed
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    export_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # The target model folder (config.json + safetensors) where training runs; None: the embedded model.
    target_weights: str | None = None
    # Checkpoint names of the target's input embedding and lm_head; None: found under the prefix the
    # checkpoint's index shows (`model.embed_tokens.weight`, or `language_model.…` for Kimi-K2.5), the
    # lm_head falling back to the embedding when the target ties them.
    embedding_key: str | None = None
    lm_head_key: str | None = None
    activation_checkpointing: bool = Field(
        default=False,
        description=(
            "Recompute each training-time-test step's decoder layer (norms, q/k/v, attention, MLP) in the backward pass "
            "instead of keeping its activations: about a third more compute for the layer, and per token and step only "
            "its hidden state, keys and values (and the logits at counted positions) stay in memory. For long sequences "
            "or a wide drafter (the MLP's activations dominate otherwise). Results are the same; a run may resume with it switched."
        ),
    )
    # Training processes (torchrun, DistributedDataParallel) where training runs; auto: one per GPU
    # that machine reports (torch's CUDA devices locally, nvidia-smi on the compute host), 1 with none.
    nproc_per_node: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"


# --- drafter evaluation (issue 10): the `drafter_eval` asset and the optional `drafter_benchmark` ---


class DrafterEvalConfig(_Model):
    """τ on the eval split (`drafter_eval`) and its blocking check `tau_regression`."""

    steps: Annotated[list[Annotated[int, Field(ge=1, le=16)]], Field(min_length=1)] = [3, 5, 7]  # draft depths K
    min_tau: Annotated[float, Field(ge=1)] = 1.0  # the check fails below this floor (every dataset, every K)
    max_tau_drop: Annotated[float, Field(ge=0)] = 0.1  # ... or this far below the previous materialization
    draft_cost_ratio: Annotated[float, Field(ge=0, lt=1)] = round(1 / 61, 4)  # c in speedup ≈ τ / (1 + K·c)
    max_samples_per_dataset: Annotated[int, Field(gt=0)] | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    min_data_agreement: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.9,
        description=(
            "A dataset whose stored next tokens are the target's argmax at fewer than this share of the eval positions "
            "gets a warning (materialization metadata, run log, the CLI's table): its responses are not the target's "
            "greedy output (temperature > 0, imported samples, re-tokenised text), so τ against them is not the server's τ."
        ),
    )


BENCHMARK_PLACEHOLDERS = frozenset(
    {"target", "drafter", "port", "tp", "steps", "draft_tokens", "speculative", "speculative_config"}
)


class DrafterBenchmarkConfig(_Model):
    """The online benchmark on the GPU host of `health.host`: the target served without and with the
    drafter by `launch_command` (`{speculative}` is empty for the baseline, `speculative_args` for the
    drafter); None for the server's default command line."""

    server: Literal["sglang", "vllm"] = "sglang"
    target_model_path: Annotated[str, Field(min_length=1)]
    draft_model_path: Annotated[str, Field(min_length=1)]
    port: Annotated[int, Field(gt=0, le=65535)] = 30100
    base_url: Annotated[str, Field(pattern=r"^https?://")] | None = None  # default http://<health.host.hostname>:<port>
    tp_size: Annotated[int, Field(gt=0)] = 1
    steps: Annotated[int, Field(ge=1, le=16)] = 3
    launch_command: Annotated[str, Field(min_length=1)] | None = None
    speculative_args: Annotated[str, Field(min_length=1)] | None = None
    process_pattern: str = ""  # the health gate's server_process pattern; "" = the server's default
    log_dir: Annotated[str, Field(pattern=r"^/")] = "/tmp/eagle3_benchmark"
    prompts: Annotated[int, Field(gt=0)] = 32
    max_tokens: Annotated[int, Field(gt=0)] = 256
    concurrency: Annotated[int, Field(gt=0)] = 1
    startup_timeout_s: Annotated[float, Field(gt=0)] = 1800.0
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0

    @field_validator("launch_command", "speculative_args")
    @classmethod
    def _known_placeholders(cls, template: str | None) -> str | None:
        if template is not None:
            fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
            unknown = fields - BENCHMARK_PLACEHOLDERS
            if unknown:
                raise ValueError(f"unknown placeholder(s) {sorted(unknown)}; allowed: {sorted(BENCHMARK_PLACEHOLDERS)}")
        return template


# --- beyond one box (issue 11): executors and alerts ---

GpuPhase = Literal["responses", "hidden_states", "eagle3_drafter", "drafter_eval"]
POOL_NAME_PATTERN = r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$"


class GpuPoolConfig(_Model):
    """A pool of GPU machines: a Kubernetes node pool (`node_selector`) or the Celery workers of one
    GPU host (`queue`, default: the pool's name)."""

    node_selector: dict[str, str] = {}
    gpus: Annotated[int, Field(gt=0)] = 1  # nvidia.com/gpu per step pod
    queue: Annotated[str, Field(pattern=POOL_NAME_PATTERN)] | None = None


class DeployConfig(_Model):
    """Which Dagster executor runs the steps, and where the GPU phases go under it. `default` is
    Dagster's own (each step a process on the run's machine): nothing else changes."""

    executor: Literal["default", "k8s", "celery"] = "default"
    gpu_pools: Annotated[dict[Annotated[str, Field(pattern=POOL_NAME_PATTERN)], GpuPoolConfig], Field(min_length=1)] = {
        "gpu": GpuPoolConfig()
    }
    phase_pools: dict[GpuPhase, str] = {}  # a GPU phase → one of gpu_pools; unlisted: the first pool

    @model_validator(mode="after")
    def _known_pools(self) -> DeployConfig:
        unknown = {phase: pool for phase, pool in self.phase_pools.items() if pool not in self.gpu_pools}
        if unknown:
            raise ValueError(
                f"phase_pools names pools not in gpu_pools: {unknown}; expected one of {sorted(self.gpu_pools)}"
            )
        return self


class AlertsConfig(_Model):
    """Notifications to a webhook (a plain JSON POST, or Slack's incoming-webhook format). The URL is
    a secret: the file names the environment variable that holds it; unset → alerts off."""

    webhook_url_env: Annotated[str, Field(pattern=ENV_VAR_PATTERN)] | None = None
    format: Literal["json", "slack"] = "json"
    timeout_s: Annotated[float, Field(gt=0, le=30)] = 5.0


class PipelineConfig(_Model):
    """One pipeline: its datasets, target model, inference backend and where outputs go."""

    name: Annotated[str, Field(pattern=DATASET_ID_PATTERN)]
    artifacts_root: Path
    seed: int = 0
    target: TargetConfig
    inference: InferenceConfig = InferenceConfig()
    generation: GenerationConfig = GenerationConfig()
    prompts: PromptsConfig = PromptsConfig()
    training_data: TrainingDataConfig = TrainingDataConfig()
    health: HealthConfig = HealthConfig()
    compute: ComputeConfig = ComputeConfig()
    draft_vocab: DraftVocabConfig = DraftVocabConfig()
    hidden_states: HiddenStatesConfig = HiddenStatesConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    launch: LaunchConfig = LaunchConfig()
    drafter: DrafterConfig = DrafterConfig()
    drafter_eval: DrafterEvalConfig = DrafterEvalConfig()
    drafter_benchmark: DrafterBenchmarkConfig | None = None
    deploy: DeployConfig = DeployConfig()
    alerts: AlertsConfig = AlertsConfig()
    datasets: Annotated[list[DatasetConfig], Field(min_length=1)]
    source_file: Path

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
                f"generation.failover.backends serve different models ({', '.join(sorted(models))}); a dataset's answers "
                "must all come from one model, so every failover backend must serve the same one"
            )
        return self

    def failover_order(self) -> list[int]:
        """The indices into ``inference.endpoints`` of ``generation.failover.backends``, in order."""
        failover = self.generation.failover
        if failover is None:
            return []
        endpoints = self.inference.endpoints
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
                    f"generation.failover.backends: {ref!r} names no entry of inference.endpoints (known names: {sorted(names)})"
                )
            if index in order:
                raise ValueError(f"generation.failover.backends: {ref!r} is listed twice")
            order.append(index)
        return order

    @model_validator(mode="after")
    def _rolling_extracts_with_our_phase(self) -> PipelineConfig:
        """Rolling windows are extracted by our `extract` phase; compute.kind command's extractor writes a whole store."""
        if self.hidden_states.rolling_window_shards is not None and self.compute.kind == "command":
            raise ValueError(
                "hidden_states.rolling_window_shards: not supported with compute.kind 'command' (the user's extractor writes the "
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
                f"every one of inference.hosts must request the same model(s), since a partition may resume on any host "
                f"from the same checkpoint (got {shown})"
            )
        return self

    def for_host(self, name: str | None) -> PipelineConfig:
        """This pipeline as one host of `inference.hosts` sees it: that host's endpoints and health
        section in place of the top-level ones (None: the first host). Without hosts: itself."""
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
        return self.model_copy(update={"inference": inference, "health": host.effective_health(self.health)})

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


def local_profile_path() -> Path:
    return Path(str(resources.files("eagle3_pipeline") / "profiles" / f"{LOCAL_PROFILE}.yaml"))


def default_config_path() -> Path:
    """The pipeline file in force: ``$EAGLE3_CONFIG`` if set, else the shipped local profile."""
    env = os.environ.get(CONFIG_ENV_VAR)
    return Path(env) if env else local_profile_path()


def _field_path(loc: tuple[Any, ...], raw: Any) -> str:
    """`('datasets', 1, 'token_budget')` → `datasets[1].token_budget` (with the dataset id)."""
    parts: list[str] = []
    node = raw
    for item in loc:
        if isinstance(item, int):
            label = f"[{item}]"
            if isinstance(node, list) and item < len(node):
                node = node[item]
                named = next(
                    (key for key in ("id", "name") if isinstance(node, dict) and isinstance(node.get(key), str)), None
                )
                if named is not None:
                    label = f"[{item}] ({named} {node[named]!r})"
            parts.append(label)
        else:
            parts.append(f".{item}" if parts else str(item))
            node = node.get(item) if isinstance(node, dict) else None
    return "".join(parts) or "<top level>"


def _describe(error: ErrorDetails, raw: Any) -> str:
    where = _field_path(tuple(error["loc"]), raw)
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{where}: unknown key (check the spelling; allowed keys are documented in README)"
    if kind == "missing":
        return f"{where}: required field is missing"
    shown = error.get("input")
    value = "" if isinstance(shown, (dict, list)) else f" (got {shown!r})"
    return f"{where}: {error['msg']}{value}"


def _resolve(path_text: str, base: Path) -> Path:
    path = Path(os.path.expanduser(path_text))
    return path if path.is_absolute() else (base / path).resolve()


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


def load_config(path: str | os.PathLike[str] | None = None, runtime_checks: bool = True) -> PipelineConfig:
    """Read and validate a pipeline file; relative paths resolve against the file's folder.

    ``runtime_checks=False`` (the code location) validates only the file itself: source files and
    API-key variables are checked when a run needs them, with the same errors, so the webserver and
    daemon load the definitions in any environment.

    ``artifacts_root`` may be omitted: then it is ``<name>`` under ``$EAGLE3_ARTIFACTS_ROOT`` or
    under ``./artifacts`` in the current working directory, so the shipped profile never writes
    inside the package and two pipelines never share files.
    """
    file = Path(path) if path is not None else default_config_path()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{file}: pipeline file does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: cannot read pipeline file ({exc.__class__.__name__}: {exc})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{file}: invalid YAML{where}: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a mapping at the top level, got {type(raw).__name__}")
    if "source_file" in raw:
        raise ConfigError(f"{file}: source_file: unknown key (it is set by the loader)")

    base = file.resolve().parent
    data = dict(raw)
    if data.get("artifacts_root") is None:
        parent = Path(os.environ.get(ARTIFACTS_ENV_VAR) or Path.cwd() / "artifacts")
        name = data.get("name")
        data["artifacts_root"] = str(parent / name if isinstance(name, str) else parent)
    if isinstance(data.get("artifacts_root"), str):
        data["artifacts_root"] = str(_resolve(data["artifacts_root"], base))
    datasets = data.get("datasets")
    if isinstance(datasets, list):
        data["datasets"] = [_with_resolved_source(item, base) for item in datasets]
    target = data.get("target")
    if isinstance(target, dict) and isinstance(target.get("tokenizer"), str):
        tok = target["tokenizer"]
        if tok.startswith((".", "/", "~")):
            data["target"] = {**target, "tokenizer": str(_resolve(tok, base))}
    data["source_file"] = file.resolve()

    try:
        config = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(err, raw) for err in exc.errors()]
        raise ConfigError(f"{file}: " + "; ".join(lines)) from None
    if runtime_checks:
        check_runtime(config)
    return config


def _with_resolved_source(item: Any, base: Path) -> Any:
    if isinstance(item, dict) and isinstance(item.get("source"), str):
        source = item["source"]
        if source and not source.startswith("hf:") and not re.match(r"^[a-z]+://", source):
            return {**item, "source": str(_resolve(source, base))}
    return item
