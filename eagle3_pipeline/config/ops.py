"""`schedule:`, `launch:`, `deploy:` and `alerts:` when generation runs, how it is relaunched, where steps run,
and who is told."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from eagle3_pipeline.config.base import ENV_VAR_PATTERN, ConfigModel
from eagle3_pipeline.config.phases import GpuPhase

CRON_PATTERN = r"^(@(yearly|annually|monthly|weekly|daily|midnight|hourly)|\S+( \S+){4})$"
POOL_NAME_PATTERN = r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$"


class ScheduleConfig(ConfigModel):
    """The scheduled backfill of missing or stale `responses` partitions: off unless `cron` is set."""

    cron: Annotated[str, Field(pattern=CRON_PATTERN)] | None = Field(
        default=None,
        description=(
            "A cron expression (five fields, or @daily, @hourly…): at the first evaluation after each tick, one "
            "Dagster backfill of the missing or stale responses partitions, behind the health gate. Unset: off."
        ),
    )
    timezone: str = Field(default="UTC", description="The time zone the cron expression is read in.")


class LaunchConfig(ConfigModel):
    """How the scheduled backfill and the health sensor relaunch a partition whose generation runs failed:
    attempt k+1 waits backoff_initial_s × 2^(k-1) (at most backoff_max_s) after failure k; after
    max_attempts consecutive failures the partition is left alone until a run succeeds."""

    max_attempts: Annotated[int, Field(gt=0, le=100)] = Field(
        default=3, description="Consecutive failed runs after which a partition is left alone until a run succeeds."
    )
    backoff_initial_s: Annotated[float, Field(ge=0)] = Field(
        default=600.0, description="Seconds after the first failure before the next attempt; doubles per failure."
    )
    backoff_max_s: Annotated[float, Field(ge=0)] = Field(default=21600.0, description="The longest wait in seconds.")
    host_wait_s: Annotated[float, Field(ge=0)] = Field(
        default=3600.0,
        description=(
            "With several inference hosts: how long, in seconds, a generation run without a host tag (a "
            "backfill's) waits for a free healthy host before it fails."
        ),
    )
    host_poll_s: Annotated[float, Field(gt=0)] = Field(
        default=5.0, description="How often, in seconds, such a run looks for a free healthy host."
    )


class GpuPoolConfig(ConfigModel):
    """A pool of GPU machines: a Kubernetes node pool (`node_selector`) or the Celery workers of one
    GPU host (`queue`, default: the pool's name)."""

    node_selector: dict[str, str] = Field(
        default={},
        description="k8s: the node labels a GPU step's pod must match, e.g. {nvidia.com/gpu.product: NVIDIA-H200}.",
    )
    gpus: Annotated[int, Field(gt=0)] = Field(default=1, description="k8s: nvidia.com/gpu per step pod.")
    queue: Annotated[str, Field(pattern=POOL_NAME_PATTERN)] | None = Field(
        default=None, description="celery: the queue of this pool's workers; default: the pool's name."
    )


class DeployConfig(ConfigModel):
    """Which Dagster executor runs the steps, and where the GPU phases go under it. `default` is
    Dagster's own (each step a process on the run's machine): nothing else changes."""

    executor: Literal["default", "k8s", "celery"] = Field(
        default="default",
        description="default: Dagster's own; k8s: each step a Kubernetes Job; celery: steps go to Celery queues.",
    )
    gpu_pools: Annotated[dict[Annotated[str, Field(pattern=POOL_NAME_PATTERN)], GpuPoolConfig], Field(min_length=1)] = (
        Field(default={"gpu": GpuPoolConfig()}, description="The GPU pools by name (see their fields).")
    )
    phase_pools: dict[GpuPhase, str] = Field(
        default={},
        description=(
            "A GPU phase → one of gpu_pools; an unlisted phase goes to the first pool. Only a step whose own "
            "process uses GPUs goes to a pool: responses with inference.kind embedded, hidden_states, "
            "eagle3_drafter and drafter_eval with compute.kind local."
        ),
    )

    @model_validator(mode="after")
    def _known_pools(self) -> DeployConfig:
        unknown = {phase: pool for phase, pool in self.phase_pools.items() if pool not in self.gpu_pools}
        if unknown:
            raise ValueError(
                f"phase_pools names pools not in gpu_pools: {unknown}; expected one of {sorted(self.gpu_pools)}"
            )
        return self


class AlertsConfig(ConfigModel):
    """Notifications to a webhook (a plain JSON POST, or Slack's incoming-webhook format). The URL is
    a secret: the file names the environment variable that holds it; unset → alerts off."""

    webhook_url_env: Annotated[str, Field(pattern=ENV_VAR_PATTERN)] | None = Field(
        default=None,
        description="The environment variable holding the webhook URL (a secret); unset: alerts off, with one warning.",
    )
    format: Literal["json", "slack"] = Field(
        default="json",
        description='json: a plain JSON POST (any webhook); slack: Slack\'s incoming webhook {"text": …}.',
    )
    timeout_s: Annotated[float, Field(gt=0, le=30)] = Field(
        default=5.0, description="Timeout of each delivery in seconds."
    )
