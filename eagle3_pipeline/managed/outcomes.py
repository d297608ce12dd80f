"""What a managed server's start, stop and status come to, typed for the Dagster layer's events and
observations: :class:`StartResult`, :class:`StopResult` with its :class:`StopVerification`, and
:class:`ServerStatus`, each with its durations and reasons."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from eagle3_pipeline.health import HealthReport
from eagle3_pipeline.managed.gpu_memory import figures
from eagle3_pipeline.managed.processes import ProcessRef, ServerRecord

State = Literal["absent", "running", "exited", "orphaned", "foreign"]


@dataclass(frozen=True)
class ServerStatus:
    """``absent``: no pid file; ``running``: its leader is the recorded process; ``exited``: it and every
    recorded process are gone, or the host rebooted since its start (another boot id: whatever runs under
    its pids now is not it); ``orphaned``: the leader is gone, recorded processes are left; ``foreign``: the
    recorded pid is a live process of another start time, group or command (same boot)."""

    state: State
    detail: str
    record: ServerRecord | None = None
    alive: tuple[ProcessRef, ...] = ()


@dataclass(frozen=True)
class StopVerification:
    """What a stop found afterwards; ``ok`` when nothing of the server is held."""

    processes_left: tuple[ProcessRef, ...]
    port: int
    port_holders: tuple[tuple[int, str], ...]  # (pid, command name); (0, why) when no owner is visible
    gpu_holders: tuple[tuple[int, int], ...]  # (pid, MiB)
    gpu_check: str
    gpu_memory: tuple[tuple[int, float, float], ...] = ()  # (GPU index, MiB used, baseline) not back to baseline
    gpu_memory_check: str = "skipped"

    @property
    def ok(self) -> bool:
        held = self.processes_left or self.port_holders or self.gpu_holders or self.gpu_memory
        return not held and not self.gpu_failed

    @property
    def gpu_failed(self) -> bool:
        return self.gpu_check.startswith("failed") or self.gpu_memory_check.startswith("failed")

    def problems(self) -> list[str]:
        found = []
        if self.processes_left:
            found.append(
                "processes of the server still alive: " + ", ".join(f"pid {p.pid}" for p in self.processes_left)
            )
        if self.port_holders:
            holders = ", ".join(f"pid {pid} ({name})" if pid else name for pid, name in self.port_holders)
            found.append(f"port {self.port} still listening, held by {holders}")
        if self.gpu_holders:
            found.append(
                "GPU memory still held by "
                + ", ".join(f"pid {pid} ({mib} MiB)" for pid, mib in self.gpu_holders)
                + " (nvidia-smi --query-compute-apps)"
            )
        if self.gpu_memory:
            found.append(f"GPU memory not back to the baseline: {figures(self.gpu_memory)} ({self.gpu_memory_check})")
        found += [check for check in (self.gpu_check, self.gpu_memory_check) if check.startswith("failed")]
        return found


@dataclass(frozen=True)
class StartResult:
    """A server started and ready: what, where, why and how long (launch to ready)."""

    server: str
    host: str
    role: str
    reason: str
    pid: int
    port: int
    command: str  # the launch line, environment by names only
    log_path: str
    pid_path: str
    duration_s: float
    members: tuple[ProcessRef, ...]
    report: HealthReport
    replaced: str | None = None  # a stale pid file this start replaced, and why it was stale
    gpu_check: str = "skipped"  # the GPUs before the start: free (with the baseline), or why not measured
    reconnects: int = 0  # SSH connections that dropped and were reopened during the start
    adopted: bool = False  # a launch already recorded (another run's, or one whose connection dropped), waited for

    def as_metadata(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "host": self.host,
            "role": self.role,
            "reason": self.reason,
            "pid": self.pid,
            "port": self.port,
            "command": self.command,
            "log_path": self.log_path,
            "duration_s": round(self.duration_s, 3),
            "processes": len(self.members),
            "gpu_check": self.gpu_check,
            "reconnects": self.reconnects,
            **({"replaced": self.replaced} if self.replaced else {}),
            **({"adopted": True} if self.adopted else {}),
        }


@dataclass(frozen=True)
class StopResult:
    """A stop: whether a server of ours was running, the signals sent, how long it took, what was verified."""

    server: str
    host: str
    reason: str
    was_running: bool
    pid: int | None
    role: str | None
    signals: tuple[str, ...]
    duration_s: float
    verification: StopVerification

    @property
    def verified(self) -> bool:
        return self.verification.ok

    def as_metadata(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "host": self.host,
            "reason": self.reason,
            "was_running": self.was_running,
            "pid": self.pid,
            "role": self.role,
            "signals": list(self.signals),
            "duration_s": round(self.duration_s, 3),
            "verified": self.verified,
            "gpu_check": self.verification.gpu_check,
            "gpu_memory_check": self.verification.gpu_memory_check,
        }
