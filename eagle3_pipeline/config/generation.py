"""`datasets:`, `prompts:` and `generation:` which prompts are sent and how their answers are generated."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, Field, field_validator, model_validator

from eagle3_pipeline.config.base import DATASET_ID_PATTERN, ConfigModel


class DatasetConfig(ConfigModel):
    """One prompt source: a partition of `prompts` and `responses`."""

    id: Annotated[str, Field(pattern=DATASET_ID_PATTERN)] = Field(
        description="The dataset's id (unique): its partition key and the stem of its files."
    )
    source: Annotated[str, Field(min_length=1)] = Field(
        description=(
            "A JSONL, JSON or Parquet file (relative paths resolve against the pipeline file), or a Hugging Face "
            "dataset as hf:<name> (needs the datasets package)."
        ),
    )
    format: Literal["auto", "sharegpt", "openai"] = Field(
        default="auto",
        description=(
            "The records' format: sharegpt (conversations of from/value), openai (messages of role/content, "
            "optional tools), or auto (per record: conversations means sharegpt, messages openai)."
        ),
    )
    sample_size: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "Keep this many records, those with the smallest sha256(seed:id), so adding or removing source records "
            "changes the sample only by those records; default: all."
        ),
    )
    token_budget: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "Tokens this dataset may generate (counted as generation.budget_counts says). Dispatching stops once "
            "they are reached; the overshoot is at most what the requests in flight can add. Default: no budget."
        ),
    )
    split: str = Field(default="train", description="The split of a Hugging Face dataset (hf: sources).")

    @property
    def is_hub_dataset(self) -> bool:
        return self.source.startswith("hf:")


class ConcurrencyConfig(ConfigModel):
    """Requests in flight at once per prompt length class, across all endpoints together."""

    short: Annotated[int, Field(gt=0, le=4096)] = Field(
        default=150, description="Requests in flight for prompts of at most prompts.long_threshold_tokens tokens."
    )
    long: Annotated[int, Field(gt=0, le=4096)] = Field(
        default=32, description="Requests in flight for prompts longer than prompts.long_threshold_tokens."
    )

    @property
    def total(self) -> int:
        return self.short + self.long


class RetryConfig(ConfigModel):
    """Bounded, jittered exponential backoff for connection errors, timeouts, 408, 429 and 5xx."""

    max_attempts: Annotated[int, Field(gt=0, le=100)] = Field(
        default=6, description="Attempts per request, the first included; 400, 401, 403, 404 are never retried."
    )
    backoff_initial_s: Annotated[float, Field(gt=0)] = Field(
        default=1.0,
        description="The first retry's backoff in seconds; it doubles per attempt, jittered into its upper half.",
    )
    backoff_max_s: Annotated[float, Field(gt=0)] = Field(
        default=60.0, description="The longest backoff in seconds, also the cap on a Retry-After the server asks for."
    )


class FailoverConfig(ConfigModel):
    """Generate on one backend at a time, in this order (``inference.endpoints`` names or indices),
    and move a dataset to the next one when its ETA on the current one passes the deadline or the
    current one turns unhealthy (``unhealthy_after_errors`` failed attempts in a row; with
    ``probe_timeout_s``, a backend that delivered no answer during a check while requests were in
    flight is sent a 1-token request, and a probe not answered in time counts as a failed attempt)."""

    backends: Annotated[list[str | int], Field(min_length=2)] = Field(
        description="The backends in order: names or indices of inference.endpoints (at least two, same model)."
    )
    deadline_s: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="The deadline in seconds from the start of the dataset's run (or set deadline)."
    )
    deadline: AwareDatetime | None = Field(
        default=None,
        description="The deadline as an absolute time (ISO 8601 with a UTC offset, e.g. 2026-12-04T06:00:00Z).",
    )
    check_every_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0, description="Seconds between checks of the current backend's rate and health."
    )
    unhealthy_after_errors: Annotated[int, Field(gt=0)] = Field(
        default=5,
        description="Failed attempts in a row (connection errors, timeouts, 5xx, 429) that make the backend unhealthy.",
    )
    probe_timeout_s: Annotated[float, Field(gt=0)] | None = Field(
        default=None,
        description=(
            "Probe a backend that delivered nothing during a check while requests were in flight with a 1-token "
            "request; not answered within this many seconds counts as a failed attempt. Default: no probe."
        ),
    )

    @model_validator(mode="after")
    def _one_deadline(self) -> FailoverConfig:
        if self.deadline_s is not None and self.deadline is not None:
            raise ValueError("set deadline_s (seconds from the run's start) or deadline (an ISO time), not both")
        return self


class GenerationConfig(ConfigModel):
    """How `responses` generates the answers: the request, concurrency, retries, budgets and durability."""

    max_tokens: Annotated[int, Field(gt=0)] = Field(
        default=256, description="Sent with every request; part of the generation fingerprint."
    )
    temperature: Annotated[float, Field(ge=0)] = Field(
        default=0.0,
        description="Sent with every request; part of the fingerprint. 0 (greedy) makes drafter_eval's τ the server's.",
    )
    concurrency: ConcurrencyConfig = Field(
        default=ConcurrencyConfig(),
        description=(
            "Requests in flight per prompt length class over all endpoints together, e.g. {short: 150, long: 32}; "
            "one number sets both."
        ),
    )
    connect_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=10.0, description="Connect timeout per request in seconds; a timeout is retried."
    )
    read_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=600.0, description="Read timeout per request in seconds; a timeout is retried."
    )
    retry: RetryConfig = Field(default=RetryConfig(), description="Retries of a failed request (see its fields).")
    max_consecutive_errors: Annotated[int, Field(gt=0)] = Field(
        default=25,
        description=(
            "That many requests failing for good in a row stop the run (the server is probably down); finished "
            "answers stay checkpointed."
        ),
    )
    max_failed_fraction: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.0,
        description="The share of a dataset's prompts that may fail for good while the asset still succeeds.",
    )
    budget_counts: Literal["completion", "prompt_and_completion"] = Field(
        default="completion", description="Which tokens count against a dataset's token_budget."
    )
    fsync: Literal["never", "interval", "always"] = Field(
        default="interval",
        description=(
            "Every answer is written at once (it survives kill -9); what also survives a power cut: never leaves "
            "syncing to the OS, interval syncs with the first answer fsync_interval_s after the last sync and at the "
            "end, always after every answer."
        ),
    )
    fsync_interval_s: Annotated[float, Field(gt=0)] = Field(
        default=1.0, description="Seconds between syncs with fsync interval."
    )
    reasoning: Literal["keep", "strip"] = Field(
        default="keep",
        description=(
            "keep the answer's message.reasoning_content / message.reasoning (the reasoning column), or strip it; "
            "part of the fingerprint."
        ),
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description=(
            "Sent with every request as chat_template_kwargs (SGLang and vLLM pass them to the chat template; e.g. "
            "{thinking: false} turns Kimi-K2.5's thinking off). training_data renders with the same kwargs, so the "
            "rows hold the prompt as the server rendered it. Part of the generation fingerprint when set."
        ),
    )
    regenerate_turns: Literal["last", "all"] = Field(
        default="last",
        description=(
            "last: regenerate the final assistant turn; all: every earlier assistant turn too, each on the "
            "regenerated history (a turn answered by a tool message is kept). Part of the fingerprint."
        ),
    )
    progress_interval_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0, description="Seconds between progress log lines and observations."
    )
    on_fingerprint_change: Literal["refuse", "new_version"] = Field(
        default="refuse",
        description=(
            "What a run does when the checkpoint was made under another generation fingerprint (model, max_tokens, "
            "temperature, ...): refuse before sending anything, or keep the old answers aside (moved under "
            "responses/previous/) and regenerate the partition."
        ),
    )
    length_estimator: Literal["tokenizer", "chars"] = Field(
        default="tokenizer",
        description=(
            "How a prompt's length is estimated before it is sent (prompt + max_tokens must fit target.max_seq_len): "
            "the target's chat template and tokenizer, or 4 characters a token."
        ),
    )
    max_empty_rate: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.02,
        description=(
            "The share of a dataset's prompts whose answer may stay empty (no content after the reasoning is split "
            "off, no tool calls) once every attempt is spent; the responses:empty_answers check."
        ),
    )
    failover: FailoverConfig | None = Field(
        default=None,
        description=(
            "Generate on one of inference.endpoints at a time and move on by deadline or health (see its fields); "
            "default: every endpoint at once."
        ),
    )

    @field_validator("concurrency", mode="before")
    @classmethod
    def _one_number_for_both_classes(cls, value: Any) -> Any:
        return value if isinstance(value, (dict, ConcurrencyConfig)) else {"short": value, "long": value}


class PromptsConfig(ConfigModel):
    """How `prompts` reads the sources."""

    long_threshold_tokens: Annotated[int, Field(gt=0)] = Field(
        default=512,
        description="Prompts of more estimated tokens than this are long (generation.concurrency.long).",
    )
    max_bad_records_listed: Annotated[int, Field(gt=0)] = Field(
        default=5,
        description="Malformed records listed, with where they are, in the asset's metadata (all are counted).",
    )
