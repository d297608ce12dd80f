"""This machine as a host: every command its own process group, killed whole on timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping

from eagle3_pipeline.hosts.host import CommandResult, Host, text


class LocalHost(Host):
    """This machine, through `/bin/sh -c`. On timeout the command's whole process group is killed."""

    def __init__(self, name: str = "localhost", env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self._env = {**os.environ, **env} if env is not None else None

    def run(self, command: str, timeout_s: float, stdin: str | None = None) -> CommandResult:
        started = time.monotonic()
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self._env,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(stdin.encode() if stdin is not None else None, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            out, err = _kill_and_collect(proc)
            return CommandResult(None, text(out), text(err), time.monotonic() - started, True)
        return CommandResult(proc.returncode, text(out), text(err), time.monotonic() - started, False)

    def close(self) -> None:
        """Nothing to release: every command is its own process."""


def _kill_and_collect(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """Kill the process group; collect what it wrote unless an escaped child holds the pipes."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=1.0)
    except subprocess.TimeoutExpired as exc:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()
        return _as_bytes(exc.stdout), _as_bytes(exc.stderr)


def _as_bytes(value: bytes | str | None) -> bytes:
    if value is None:
        return b""
    return value.encode() if isinstance(value, str) else value
