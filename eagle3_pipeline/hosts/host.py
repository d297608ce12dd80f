"""What every host is: somewhere a shell command runs (:class:`Host`), what a command did
(:class:`CommandResult`), the errors of a host that cannot be reached, and the quoting every command
line goes through."""

from __future__ import annotations

import os
import shlex
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType


@dataclass(frozen=True)
class CommandResult:
    """What a command did. `exit_code` is None when it timed out or died without a status."""

    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class HostError(Exception):
    """The host could not be reached or the connection failed; no exit status exists."""


class HostConnectError(HostError):
    """Connecting (TCP, SSH banner, key exchange) failed or timed out."""


class HostAuthError(HostError):
    """The SSH server refused our credentials."""


class HostKeyError(HostError):
    """The SSH server's host key is not known, or differs from the known one."""

    def __init__(self, message: str, *, host: str, fingerprint: str) -> None:
        super().__init__(message)
        self.host = host
        self.fingerprint = fingerprint


class HostDisconnectedError(HostError):
    """The connection dropped while a command was running; its outcome is unknown."""


def quote_args(*args: str | os.PathLike[str] | int | float) -> str:
    """Join arguments into one shell command line, each one quoted with `shlex.quote`."""
    return " ".join(shlex.quote(os.fspath(a) if isinstance(a, os.PathLike) else str(a)) for a in args)


class Host(ABC):
    """Somewhere a shell command can run."""

    name: str

    @abstractmethod
    def run(self, command: str, timeout_s: float, stdin: str | None = None) -> CommandResult:
        """Run `command` with a POSIX shell; `timeout_s` bounds the whole call. `stdin` is written to its
        standard input (then closed; none: an empty input): how a secret reaches a host without a command line."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the host stays usable (it reconnects on the next `run`)."""

    def __enter__(self) -> Host:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def kill_process_group(host: Host, pgid: int, grace_s: float) -> bool:
    """SIGTERM the process group `pgid` on `host`, SIGKILL it after `grace_s`; True when no live
    process of the group is left (zombies waiting for their parent do not count)."""
    live = f"ps -eo pgid=,stat= | awk '$1 == {int(pgid)} && $2 !~ /^Z/' | grep -q ."
    script = (
        f"env kill -TERM -- -{int(pgid)} 2>/dev/null; i=0; "
        f"while {live} && [ $i -lt {max(1, int(grace_s * 10))} ]; do sleep 0.1; i=$((i+1)); done; "
        f"env kill -KILL -- -{int(pgid)} 2>/dev/null; sleep 0.2; "
        f"if {live}; then echo alive; else echo gone; fi"
    )
    result = host.run(script, timeout_s=grace_s + 30.0)
    return result.stdout.strip().endswith("gone")
