"""`health:` where the health probes run, the server they watch, and the floors the gate applies."""

from __future__ import annotations

import getpass
from typing import Annotated, Literal

from pydantic import Field, model_validator

from eagle3_pipeline.config.base import ENV_VAR_PATTERN, ConfigModel, HttpUrl


class HostConfig(ConfigModel):
    """Where the health probes run: this machine, or the GPU box over SSH (host key verified).

    An encrypted `key_file` is decrypted with the passphrase in the environment variable named by
    `key_passphrase_env` (read when connecting, never logged). The SSH agent is offered too unless
    `allow_agent` is false.
    """

    kind: Literal["local", "ssh"] = Field(
        default="local", description="local: probe this machine; ssh: probe the host named by hostname over SSH."
    )
    hostname: str | None = Field(default=None, description="The SSH host's name or address; required with kind ssh.")
    port: Annotated[int, Field(gt=0, le=65535)] = Field(default=22, description="The SSH port.")
    username: str | None = Field(default=None, description="The SSH user; default: the current user.")
    key_file: str | None = Field(
        default=None, description="The private key to log in with (e.g. ~/.ssh/id_ed25519); default: the agent's keys."
    )
    key_passphrase_env: Annotated[str, Field(pattern=ENV_VAR_PATTERN)] | None = Field(
        default=None,
        description=(
            "The environment variable holding key_file's passphrase when the key is encrypted (read when "
            "connecting, never logged); needs key_file."
        ),
    )
    allow_agent: bool = Field(default=True, description="Also offer the SSH agent's keys, after key_file.")
    known_hosts: str = Field(
        default="~/.ssh/known_hosts",
        description="The known_hosts file the host key is verified against; an unknown or changed key is refused.",
    )
    trust_on_first_use: bool = Field(
        default=False,
        description=(
            "Record an unknown host key in known_hosts once instead of refusing it; a changed key is still refused."
        ),
    )
    connect_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=10.0, description="Seconds to wait for the SSH connection."
    )

    def state_dir(self, artifacts_root: str, leaf: str) -> str:
        """The default folder of the pipeline's private state on this host (pid files, logs, env files):
        ``<artifacts_root>/<leaf>`` on this machine; on an SSH host, under the SSH user's home
        (``/home/<user>``, ``/root`` for root), ``.local/state/eagle3_pipeline/<leaf>``."""
        if self.kind == "local":
            return f"{artifacts_root.rstrip('/')}/{leaf}"
        user = self.username or getpass.getuser()
        home = "/root" if user == "root" else f"/home/{user}"
        return f"{home}/.local/state/eagle3_pipeline/{leaf}"

    @model_validator(mode="after")
    def _ssh_needs_a_hostname(self) -> HostConfig:
        if self.kind == "ssh" and not self.hostname:
            raise ValueError("kind 'ssh' needs health.host.hostname")
        if self.key_passphrase_env and not self.key_file:
            raise ValueError("key_passphrase_env needs health.host.key_file (the encrypted key it unlocks)")
        return self


class MonitoredServerConfig(ConfigModel):
    """The inference server the health checks watch (for the embedded profile: leave it out)."""

    kind: Literal["sglang", "vllm", "transformers", "custom"] = Field(
        default="sglang",
        description=(
            "Which server it is; decides the process and port checks (e.g. one scheduler per TP rank for sglang)."
        ),
    )
    port: Annotated[int, Field(gt=0, le=65535)] = Field(
        description="The port the server listens on (the port check wants it owned by the server's process)."
    )
    base_url: HttpUrl | None = Field(
        default=None,
        description=(
            "The server's base URL for the generation probe; default: the first inference endpoint's (required "
            "when there is none)."
        ),
    )
    tp_size: Annotated[int, Field(gt=0)] = Field(
        default=1, description="Tensor-parallel ranks the server runs with (SGLang: one scheduler process each)."
    )
    process_pattern: str = Field(
        default="",
        description=(
            "The server_process check's command-line pattern; empty: the server kind's own (e.g. "
            "python -m sglang.launch_server, not a wrapper that mentions it)."
        ),
    )
    generation_probe: Literal["chat", "health_generate"] = Field(
        default="chat",
        description=(
            "How the generation check asks the server: a real 1-token chat completion, or SGLang's /health_generate."
        ),
    )
    log_path: Annotated[str, Field(pattern=r"^/")] | None = Field(
        default=None, description="The server's log file on the host (absolute); the progress check watches it grow."
    )


CheckName = Literal["server_process", "port", "generation", "throughput", "gpus", "disk", "host_memory", "progress"]


class HealthConfig(ConfigModel):
    """The health gate: where its probes run, what it watches, and the floors each check applies."""

    host: HostConfig = Field(default=HostConfig(), description="Where the probes run (see its fields).")
    server: MonitoredServerConfig | None = Field(
        default=None, description="The inference server the checks watch; leave it out for the embedded profile."
    )
    expected_gpus: Annotated[int, Field(ge=0)] = Field(
        default=0, description="GPUs the gpus check expects on the host; 0: no GPUs required."
    )
    min_disk_free_gb: Annotated[float, Field(ge=0)] = Field(
        default=5.0, description="The disk check's floor: free space on the output volume (watch_dir), in GB."
    )
    min_mem_free_gb: Annotated[float, Field(ge=0)] = Field(
        default=1.0, description="The host_memory check's floor: free RAM, in GB."
    )
    watch_dir: Annotated[str, Field(pattern=r"^/")] | None = Field(
        default=None,
        description=(
            "The folder on the host (absolute) whose disk and output files the checks watch; default: the "
            "artifacts root on a local host."
        ),
    )
    stall_window_s: Annotated[float, Field(gt=0)] = Field(
        default=600.0,
        description=(
            "The progress check, and the generation_stall sensor: a server log or output (a generation's "
            "checkpoint) that did not advance for this many seconds is stalled."
        ),
    )
    shell_section_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=5.0, description="Timeout of each shell probe of a tick (ps, ss, df, nvidia-smi…), in seconds."
    )
    generation_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0,
        description=(
            "Timeout of the generation check's 1-token completion (or SGLang's /health_generate), in seconds; "
            "longer than SGLang's own 20 s wait there, so a busy server's answer is heard."
        ),
    )
    tick_timeout_s: Annotated[float, Field(gt=0, le=50)] = Field(
        default=40.0,
        description=(
            "Deadline of one whole health tick, in seconds (kept inside Dagster's sensor limit); longer than "
            "generation_timeout_s, so the generation check ends on its own timeout."
        ),
    )
    hosted_probe_interval_s: Annotated[float, Field(gt=0)] = Field(
        default=300.0,
        description=(
            "Hosted endpoints (with api_key_env) get a real completion at most this often, in seconds; their "
            "last verdict is reused, with its age, in between."
        ),
    )
    kernel_log_path: Annotated[str, Field(pattern=r"^/")] = Field(
        default="/var/log/kern.log",
        description="Where the gpus check reads Xids when neither dmesg nor journalctl -k can read the kernel log.",
    )
    optional_checks: list[CheckName] = Field(
        default=[], description="Checks reported but not gating (e.g. [progress]); they never count in the verdict."
    )
    sensor_interval_s: Annotated[int, Field(ge=5)] = Field(
        default=30, description="Seconds between ticks of the inference_health sensor (top-level health only)."
    )
    terminate_stalled_runs: bool = Field(
        default=False,
        description=(
            "The generation_stall sensor terminates a stalled run instead of only flagging it (top-level only)."
        ),
    )
    max_truncation_rate: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.5,
        description="The responses:truncation_rate check fails when more than this share of answers hit max_tokens.",
    )

    @model_validator(mode="after")
    def _tick_outlasts_the_generation_probe(self) -> HealthConfig:
        if self.tick_timeout_s <= self.generation_timeout_s:
            raise ValueError(
                f"tick_timeout_s: {self.tick_timeout_s:g} s, but the generation check may take generation_timeout_s "
                f"= {self.generation_timeout_s:g} s; give the tick longer (or the check less), or its verdict is cut "
                "to UNKNOWN"
            )
        return self


# Settings of the one health sensor, so they stay in the top-level `health` section.
SENSOR_ONLY_HEALTH_FIELDS = ("sensor_interval_s", "terminate_stalled_runs")
