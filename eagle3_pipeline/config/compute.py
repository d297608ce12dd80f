"""`compute:` where the heavy phases (hidden_states, drafter training and evaluation) run."""

from __future__ import annotations

import string
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from eagle3_pipeline.config.base import ConfigModel
from eagle3_pipeline.config.health import HostConfig

COMMAND_PLACEHOLDERS = ("output_dir", "run_dir", "workdir", "artifacts_root", "python", "spec")


class ComputeConfig(ConfigModel):
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

    kind: Literal["local", "ssh", "command"] = Field(
        default="local",
        description=(
            "local: the phase in the run's process; ssh: this project's worker on the GPU host as a Dagster Pipes "
            "process; command: for hidden_states, a user command on the host whose SpecForge output is imported "
            "there (the other phases as for ssh)."
        ),
    )
    host: HostConfig = Field(
        default=HostConfig(),
        description="The GPU host, with the keys of health.host (kind defaults to ssh here); required unless local.",
    )
    python: Annotated[str, Field(min_length=1)] = Field(
        default="python3",
        description="The host's Python with this project installed (e.g. /opt/eagle3/.venv/bin/python).",
    )
    workdir: Annotated[str, Field(pattern=r"^/")] | None = Field(
        default=None,
        description=(
            "Absolute folder on the host holding one folder per run (spec, Pipes messages, pid, exit status, logs); "
            "required unless local."
        ),
    )
    artifacts_root: Annotated[str, Field(pattern=r"^/")] | None = Field(
        default=None,
        description=(
            "Absolute folder on the host that mirrors the local artifacts root; outputs stay there. Required "
            "unless local."
        ),
    )
    command: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "kind command: the extraction command, a template in which {output_dir} (where it must write SpecForge "
            "files), {run_dir}, {workdir}, {artifacts_root}, {python} and {spec} are replaced by shell-quoted values; "
            "literal braces as {{ and }}."
        ),
    )
    gpus: Annotated[int, Field(ge=0)] = Field(
        default=0, description="GPUs that must be free on the host before a phase starts."
    )
    gpu_free_memory_mib: Annotated[float, Field(ge=0)] = Field(
        default=1024.0, description="A GPU is free when less than this much of its memory is in use, in MiB."
    )
    kill_grace_s: Annotated[float, Field(gt=0)] = Field(
        default=10.0,
        description="Terminating a run sends the remote process group SIGTERM, then SIGKILL after this many seconds.",
    )
    reconnect_timeout_s: Annotated[float, Field(ge=0)] = Field(
        default=60.0,
        description=(
            "How long, in seconds, to try to reach the host again after a dropped connection before the step "
            "fails (the worker keeps running)."
        ),
    )
    heartbeat_timeout_s: Annotated[float, Field(ge=5)] = Field(
        default=30.0,
        description=(
            "A connection silent for this many seconds counts as dropped (the host sends a heartbeat about every "
            "second)."
        ),
    )

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
