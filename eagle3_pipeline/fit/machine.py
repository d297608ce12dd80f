"""The machine a phase runs on: declared in the pipeline file (``machine:``) or read live on the host in one
command: the health check's ``nvidia-smi --query-gpu`` (name, memory.total, memory.used among its fields,
eagle3_pipeline.health.checks.gpus), the free disk under the artifacts root, ``MemAvailable``."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from typing import Any

from eagle3_pipeline.config import MachineConfig
from eagle3_pipeline.fit.gpus import GIB, MIB, GpuSpec, gpu_spec
from eagle3_pipeline.health.checks.gpus import GpuParseError, nvidia_smi_argv, parse_gpu_csv
from eagle3_pipeline.hosts import Host, HostError

LIVE_TIMEOUT_S = 20.0
_SEPARATOR = "--eagle3-fit--"


@dataclass(frozen=True)
class Machine:
    """What the resource model knows of the GPU host; None: unknown."""

    source: str
    gpu_name: str | None = None
    gpu_bytes: int | None = None  # per GPU, total
    gpus: int | None = None
    host_bytes: int | None = None
    disk_bytes: int | None = None

    @property
    def spec(self) -> GpuSpec | None:
        return gpu_spec(self.gpu_name) if self.gpu_name else None

    def describe(self) -> str:
        gpus = f"{self.gpus} × " if self.gpus else "? × "
        card = self.gpu_name or "unknown GPU"
        memory = f" ({self.gpu_bytes / GIB:.1f} GiB)" if self.gpu_bytes else ""
        host = f"{self.host_bytes / GIB:,.0f} GiB" if self.host_bytes else "?"
        disk = f"{self.disk_bytes / GIB:,.0f} GiB" if self.disk_bytes else "?"
        return f"{gpus}{card}{memory}, host memory {host}, free disk {disk} ({self.source})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "gpu": self.gpu_name,
            "gpu_gib": None if self.gpu_bytes is None else round(self.gpu_bytes / GIB, 2),
            "gpus": self.gpus,
            "host_memory_gib": None if self.host_bytes is None else round(self.host_bytes / GIB, 1),
            "disk_free_gib": None if self.disk_bytes is None else round(self.disk_bytes / GIB, 1),
        }


def declared(machine: MachineConfig, default_gpus: int | None = None) -> Machine:
    """The machine as ``machine:`` declares it (``gpu_memory_gib`` over the card's table figure)."""
    spec = gpu_spec(machine.gpu) if machine.gpu else None
    if machine.gpu and spec is None and machine.gpu_memory_gib is None:
        from eagle3_pipeline.fit.gpus import known_gpus

        raise ValueError(
            f"machine.gpu {machine.gpu!r}: not a card the resource model knows ({known_gpus()}); "
            "set machine.gpu_memory_gib as well"
        )
    gpu_bytes = int(machine.gpu_memory_gib * GIB) if machine.gpu_memory_gib else (spec.memory_bytes if spec else None)
    return Machine(
        "declared in machine:",
        gpu_name=machine.gpu or (spec.name if spec else None),
        gpu_bytes=gpu_bytes,
        gpus=machine.gpus or (default_gpus if gpu_bytes else None),
        host_bytes=int(machine.host_memory_gib * GIB) if machine.host_memory_gib else None,
        disk_bytes=int(machine.disk_free_gib * GIB) if machine.disk_free_gib else None,
    )


def live_command(root: str) -> str:
    """One round trip: the GPU inventory, the free bytes under ``root`` (its nearest existing folder) and
    MemAvailable; each part may fail alone."""
    quoted = shlex.quote(root)
    return (
        f"{shlex.join(nvidia_smi_argv())} 2>/dev/null; echo {_SEPARATOR}; "
        f'd={quoted}; while [ ! -e "$d" ] && [ "$d" != / ]; do d=$(dirname "$d"); done; '
        f'df -B1 --output=avail "$d" 2>/dev/null | tail -n 1; echo {_SEPARATOR}; '
        "grep MemAvailable /proc/meminfo 2>/dev/null"
    )


def parse_live(text: str, where: str) -> Machine:
    """The machine from :func:`live_command`'s output; a part that did not answer stays unknown."""
    parts = (text.split(_SEPARATOR) + ["", "", ""])[:3]
    try:
        gpus = [g for g in parse_gpu_csv(parts[0]) if g.memory_total_mib is not None]
    except GpuParseError:
        gpus = []
    disk = parts[1].strip()
    memory = parts[2].split()
    machine = Machine(
        f"nvidia-smi, df and /proc/meminfo on {where}",
        disk_bytes=int(disk) if disk.isdigit() else None,
        host_bytes=int(memory[1]) * 1024 if len(memory) >= 2 and memory[1].isdigit() else None,
    )
    if not gpus:
        return replace(machine, gpus=0)
    return replace(
        machine,
        gpu_name=gpus[0].name,
        gpu_bytes=int(min(g.memory_total_mib or 0 for g in gpus) * MIB),
        gpus=len(gpus),
    )


def live(host: Host, root: str, where: str) -> Machine:
    """The machine as the host reports it now (:func:`live_command`); unknown parts where it could not."""
    try:
        result = host.run(live_command(root), LIVE_TIMEOUT_S)
    except HostError as exc:
        return Machine(f"{where}: not reachable ({exc})")
    return parse_live(result.stdout, where)


def combined(live_machine: Machine, declared_machine: Machine) -> Machine:
    """What was measured, the declaration where a measurement is missing."""
    if live_machine.gpus:
        source = live_machine.source
    elif live_machine.disk_bytes or live_machine.host_bytes:
        source = f"GPUs {declared_machine.source} (none found live); {live_machine.source}"
    else:
        source = declared_machine.source
    return Machine(
        source,
        gpu_name=live_machine.gpu_name or declared_machine.gpu_name,
        gpu_bytes=live_machine.gpu_bytes or declared_machine.gpu_bytes,
        gpus=live_machine.gpus or declared_machine.gpus,
        host_bytes=live_machine.host_bytes or declared_machine.host_bytes,
        disk_bytes=live_machine.disk_bytes or declared_machine.disk_bytes,
    )
