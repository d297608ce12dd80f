"""Run a phase on the GPU host over SSH (``compute: ssh`` and ``command``), without Dagster.

One :class:`RemoteRun` is one phase run on the host, in its own folder
``<workdir>/runs/<run>-<phase>-<stamp>/`` holding ``spec.json``, the Pipes message file, and for
each process it starts (``worker``, ``command``): ``NAME.pid`` (the process group), ``NAME.id`` (its pid,
start time and boot id), ``NAME.log``
(its stdout and stderr) and ``NAME.status`` (its exit status, written when it exits).

- Paths: the local artifacts root maps onto ``compute.artifacts_root`` on the host; every string
  of the spec that is a path under the local root is rewritten to the same relative path there
  (:meth:`RemoteRun.translate`). Shipped inputs land at their mapped paths; fetched outputs
  come back to theirs.
- Processes start detached (``setsid``, stdin from ``/dev/null``, output to files), so a dropped
  SSH connection does not kill them; :meth:`RemoteRun.follow` streams a file of the run
  (``tail -F --pid``) until the process exits, and after a drop reconnects, reports the
  process's fate and continues from the byte it had reached (a host that cannot be reached at
  the start is retried the same way, so a process that never started is reported as such).
- :meth:`RemoteRun.kill` ends the whole process group (SIGTERM, then SIGKILL after
  ``compute.kill_grace_s``) and says whether anything is left, only while the group's leader is the
  process recorded in ``NAME.id`` when it started (pid, start time, boot id): a pid reused after the
  process exited, or after a reboot, is never signalled.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from eagle3_pipeline.compute import worker_argv
from eagle3_pipeline.config import ComputeConfig
from eagle3_pipeline.health.checks.gpus import GpuParseError, nvidia_smi_argv, parse_gpu_csv
from eagle3_pipeline.hosts import (
    HostConnectError,
    HostDisconnectedError,
    HostError,
    SshHost,
    quote_args,
)
from eagle3_pipeline.hosts.identity import RECORD_IDENTITY, ProcessIdentity, kill_recorded_group
from eagle3_pipeline.records import sha256_file

WORKER = "worker"
COMMAND = "command"
MESSAGES = "messages.jsonl"
SPEC = "spec.json"
_FOLLOW_POLL_S = 0.2
_HEARTBEAT_EVERY = 5  # polls: the follower writes a line to stderr about every second
# A process just started may not have made its own group yet (setsid runs after the fork): until
# its status file exists the follower waits this many polls for the group to appear.
_STARTUP_POLLS = 50
_RECONNECT_PAUSE_S = 1.0


class RemoteError(RuntimeError):
    """The remote phase could not start, failed, or its connection was lost for good."""


class GpusBusy(RemoteError):
    """Fewer free GPUs than the phase needs (something, e.g. an inference server, holds them)."""


@dataclass(frozen=True)
class Fate:
    """What became of a remote process: running, exited with a status, or gone without one."""

    pid: int | None
    running: bool
    exit_code: int | None

    def describe(self) -> str:
        if self.pid is None:
            return "never started (no pid file)"
        if self.running:
            return f"still running (pid {self.pid})"
        if self.exit_code is not None:
            return f"exited with status {self.exit_code} (pid {self.pid})"
        return f"gone without an exit status (pid {self.pid}: killed by a signal, or the host restarted)"


def _files_under(paths: Sequence[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            yield path
        else:
            raise RemoteError(f"cannot ship {path}: no such file or folder")


class RemoteRun:
    """One phase run in its own folder on the host; see the module docstring."""

    def __init__(
        self,
        host: SshHost,
        compute: ComputeConfig,
        local_root: Path,
        run_id: str,
        phase: str,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        if compute.workdir is None or compute.artifacts_root is None:
            raise RemoteError("compute.workdir and compute.artifacts_root must be set for a remote phase")
        self.host = host
        self.compute = compute
        self.local_root = Path(local_root).resolve()
        self.remote_root = PurePosixPath(compute.artifacts_root)
        self.run_dir = PurePosixPath(compute.workdir) / "runs" / f"{run_id}-{phase}-{time.strftime('%Y%m%d%H%M%S')}"
        self.warn = warn or _ignore

    # -- paths -------------------------------------------------------------------------------

    def to_remote(self, local: str | os.PathLike[str]) -> str:
        path = Path(local).resolve()
        try:
            relative = path.relative_to(self.local_root)
        except ValueError:
            raise RemoteError(
                f"{path} is not under the artifacts root {self.local_root}; only files there can be shipped"
            ) from None
        return str(self.remote_root / relative.as_posix()) if relative.parts else str(self.remote_root)

    def translate(self, value: Any) -> Any:
        """The spec with every path under the local artifacts root mapped onto the host's root."""
        if isinstance(value, Mapping):
            return {key: self.translate(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.translate(item) for item in value]
        if isinstance(value, str) and os.path.isabs(value):
            path = Path(value)
            if path == self.local_root or self.local_root in path.parents:
                return self.to_remote(path)
        return value

    # -- preflight ---------------------------------------------------------------------------

    def gpu_count(self) -> int:
        """The GPUs nvidia-smi reports on the host; 0 when it reports none or cannot run."""
        result = self.host.run(quote_args(*nvidia_smi_argv()), timeout_s=30.0)
        if not result.ok:
            return 0
        try:
            return len(parse_gpu_csv(result.stdout))
        except GpuParseError:
            return 0

    def check_gpus(self, need: int | None = None, setting: str = "compute.gpus") -> str:
        """Raise :class:`GpusBusy` unless ``need`` GPUs (default ``compute.gpus``; ``setting`` names
        where the number comes from) have less than ``compute.gpu_free_memory_mib`` memory in use;
        returns a one-line summary."""
        need = self.compute.gpus if need is None else need
        if need == 0:
            return "no GPU required"
        result = self.host.run(quote_args(*nvidia_smi_argv()), timeout_s=30.0)
        if not result.ok:
            raise GpusBusy(
                f"cannot verify that {need} GPU(s) ({setting}) are free on {self.host.name}: nvidia-smi exited with "
                f"{result.exit_code}: {result.stderr.strip()[:200]}"
            )
        try:
            gpus = parse_gpu_csv(result.stdout)
        except GpuParseError as exc:
            raise GpusBusy(
                f"cannot verify that {need} GPU(s) ({setting}) are free on {self.host.name}: {exc}"
            ) from None
        limit = self.compute.gpu_free_memory_mib
        free = [g for g in gpus if g.memory_used_mib is not None and g.memory_used_mib < limit and not g.faults]
        table = ", ".join(f"GPU {g.index}: {g.memory_used_mib} MiB used" for g in gpus)
        if len(free) < need:
            raise GpusBusy(
                f"{len(free)} of {len(gpus)} GPU(s) on {self.host.name} are free (< {limit:g} MiB "
                f"used, compute.gpu_free_memory_mib), {need} needed ({setting}); stop the inference "
                f"server holding them first ({table})"
            )
        return f"{len(free)} of {len(gpus)} GPU(s) free on {self.host.name}, {need} needed"

    def check_python(self, python: str, setting: str) -> None:
        """Raise :class:`RemoteError` unless ``python`` (named by ``setting``) runs on the host."""
        result = self.host.run(f"command -v {shlex.quote(python)}", timeout_s=30.0)
        if not result.ok:
            raise RemoteError(
                f"{setting}: {python!r} is not an executable on {self.host.name} (expected the python of "
                "the venv to run the phase with)"
            )

    # -- files -------------------------------------------------------------------------------

    def prepare(self) -> None:
        self._run_checked(f"mkdir -p {quote_args(self.run_dir)}", "create the run folder")

    def ship(self, paths: Sequence[str | os.PathLike[str]]) -> dict[str, int]:
        """Upload files (folders: every file under them) to their mapped paths on the host,
        skipping a file already there with the same size and sha256."""
        files = list(_files_under([Path(p) for p in paths]))
        if not files:
            return {"shipped_files": 0, "shipped_bytes": 0, "already_there": 0}
        remote = [self.to_remote(f) for f in files]
        probe = (
            "for f in " + quote_args(*remote) + '; do if [ -f "$f" ]; then '
            'printf "%s %s\\n" "$(stat -c %s -- "$f")" "$(sha256sum -- "$f" | cut -d " " -f 1)"; '
            "else echo missing; fi; done"
        )
        found = self._run_checked(probe, "check the files already on the host").splitlines()
        todo = [
            (local, target)
            for local, target, there in zip(files, remote, found, strict=True)
            if there != f"{local.stat().st_size} {sha256_file(local)}"
        ]
        folders = sorted({str(PurePosixPath(t).parent) for _, t in todo})
        if folders:
            self._run_checked("mkdir -p " + quote_args(*folders), "create the input folders")
        for local, target in todo:
            self.host.upload(local, target)
        return {
            "shipped_files": len(todo),
            "shipped_bytes": sum(local.stat().st_size for local, _ in todo),
            "already_there": len(files) - len(todo),
        }

    def write_spec(self, spec: Mapping[str, Any]) -> str:
        target = str(self.run_dir / SPEC)
        with tempfile.TemporaryDirectory() as folder:
            local = Path(folder) / SPEC
            local.write_text(json.dumps(spec, indent=2))
            self.host.upload(local, target)
        return target

    def remove(self, folder: str) -> None:
        """Delete ``folder`` on the host, which must be under its artifacts root (e.g. an imported output)."""
        path = PurePosixPath(folder)
        if self.remote_root not in path.parents or ".." in path.parts:
            raise RemoteError(f"refusing to delete {folder}: not under the host's artifacts root {self.remote_root}")
        self._run_checked(f"rm -rf {quote_args(path)}", f"delete {folder}")

    def fetch(self, relative_paths: Sequence[str]) -> list[Path]:
        """Download files under the host's artifacts root to the same place under the local root."""
        fetched = []
        for relative in relative_paths:
            if PurePosixPath(relative).is_absolute() or ".." in PurePosixPath(relative).parts:
                raise RemoteError(f"fetch path {relative!r}: expected a path relative to the artifacts root")
            local = self.local_root / relative
            local.parent.mkdir(parents=True, exist_ok=True)
            self.host.download(str(self.remote_root / relative), local)
            fetched.append(local)
        return fetched

    # -- processes ---------------------------------------------------------------------------

    def worker_command(self, phase: str, python: str, env: Mapping[str, str], processes: int = 1) -> str:
        """``env K=V … <python> -m eagle3_pipeline.worker PHASE --spec spec.json`` (under torchrun
        with ``processes`` > 1, see :func:`worker_argv`), every word shell-quoted."""
        assignments = [f"{key}={value}" for key, value in env.items()]
        prefix = ["env", *assignments] if assignments else []
        return quote_args(*prefix, *worker_argv(phase, SPEC, python, processes))

    def user_command(self, template: str, output_dir: str) -> str:
        """The ``compute.command`` template with every placeholder a shell-quoted value."""
        values = {
            "output_dir": output_dir,
            "run_dir": str(self.run_dir),
            "workdir": str(self.compute.workdir),
            "artifacts_root": str(self.remote_root),
            "python": self.compute.python,
            "spec": str(self.run_dir / SPEC),
        }
        return template.format(**{key: shlex.quote(value) for key, value in values.items()})

    def start(self, name: str, command: str, follow: str, on_line: Callable[[str], None]) -> Fate:
        """Start ``command`` detached in its own process group and stream ``follow`` (a file of
        the run folder) line by line until the process exits; returns its fate."""
        script = (
            f"cd {quote_args(self.run_dir)} || exit 97; : >> {shlex.quote(follow)}; "
            f"( setsid sh -c {shlex.quote(_with_status(command, name))} </dev/null >{name}.log 2>&1 "
            f"& p=$!; echo $p > {name}.pid; {RECORD_IDENTITY} > {name}.id ); " + _tail(name, follow, 0)
        )
        return self._follow(name, follow, script, on_line)

    def _follow(self, name: str, follow: str, script: str, on_line: Callable[[str], None]) -> Fate:
        offset = 0

        def line(text: str) -> None:
            nonlocal offset
            offset += len(text.encode()) + 1
            on_line(text)

        while True:
            try:
                self.host.stream(script, line, _ignore, idle_timeout_s=self.compute.heartbeat_timeout_s)
                remainder = self.host.run(
                    f"cd {quote_args(self.run_dir)} && tail -c +{offset + 1} {shlex.quote(follow)}", timeout_s=120.0
                )
                for text in remainder.stdout.splitlines():
                    line(text)
                return self.fate(name)
            except (HostDisconnectedError, HostConnectError) as exc:
                fate = self._fate_after_drop(name, exc)
                self.warn(
                    f"connection to {self.host.name} dropped while following the {name}; reconnected: "
                    f"it is {fate.describe()}; continuing from byte {offset} of {follow}"
                )
                script = f"cd {quote_args(self.run_dir)} || exit 97; {_tail(name, follow, offset)}"

    def _fate_after_drop(self, name: str, error: HostError) -> Fate:
        deadline = time.monotonic() + self.compute.reconnect_timeout_s
        while True:
            self.host.close()
            try:
                return self.fate(name)
            except HostError:
                if time.monotonic() >= deadline:
                    raise RemoteError(
                        f"connection to {self.host.name} lost ({error}) and not back within "
                        f"{self.compute.reconnect_timeout_s:g} s: the {name} process of {self.run_dir} may still be "
                        f"running (its pid is in {name}.pid there); its fate is unknown"
                    ) from None
                time.sleep(_RECONNECT_PAUSE_S)

    def fate(self, name: str) -> Fate:
        """Read ``NAME.pid`` and ``NAME.status`` and whether the process group is alive."""
        script = (
            f'cd {quote_args(self.run_dir)} && pid=$(cat {name}.pid 2>/dev/null); echo "pid $pid"; '
            f'echo "status $(cat {name}.status 2>/dev/null)"; '
            f'if [ -n "$pid" ] && {_alive("$pid")}; then echo running; else echo stopped; fi'
        )
        result = self.host.run(script, timeout_s=30.0)
        pairs = (line.partition(" ") for line in result.stdout.splitlines() if " " in line)
        fields = {key: value for key, _, value in pairs}
        pid_text, status_text = fields.get("pid", "").strip(), fields.get("status", "").strip()
        return Fate(
            pid=int(pid_text) if pid_text.isdigit() else None,
            running=result.stdout.rstrip().endswith("running"),
            exit_code=int(status_text) if status_text.lstrip("-").isdigit() else None,
        )

    def kill(self, name: str) -> Fate:
        """End process group ``name`` (SIGTERM, SIGKILL after the grace time) while its leader is the process
        recorded in ``NAME.id`` (pid, start time, boot id); a reused pid is left alone, and said so. Returns
        its fate."""
        fate = self.fate(name)
        if fate.pid is None:
            return fate
        text = self.host.run(f"cat {quote_args(self.run_dir / f'{name}.id')}", timeout_s=30.0).stdout
        identity = ProcessIdentity.parse(text.strip())
        if identity is None or identity.pid != fate.pid:
            self.warn(f"the {name} of {self.run_dir} has no identity recorded ({name}.id): nothing was signalled")
            return fate
        outcome = kill_recorded_group(self.host, identity, self.compute.kill_grace_s)
        if outcome.refused is not None:
            self.warn(f"not signalling the {name} of {self.run_dir}: {outcome.refused}; nothing was signalled")
        return self.fate(name)

    def log_tail(self, name: str, lines: int = 30) -> str:
        result = self.host.run(f"tail -n {int(lines)} {quote_args(self.run_dir / f'{name}.log')}", timeout_s=30.0)
        return result.stdout

    def _run_checked(self, command: str, what: str) -> str:
        result = self.host.run(command, timeout_s=600.0)
        if not result.ok:
            raise RemoteError(
                f"cannot {what} on {self.host.name}: exit {result.exit_code}: {result.stderr.strip()[:300]}"
            )
        return result.stdout


def _with_status(command: str, name: str) -> str:
    """Run ``command``, then record its exit status atomically in ``NAME.status``."""
    return f"{command}\necho $? > {name}.status.partial && mv {name}.status.partial {name}.status"


def _alive(pgid: str) -> str:
    """A shell test: some process of group ``pgid`` is alive (zombies do not count: an orphan
    is not reaped on hosts whose init does not reap)."""
    return f"ps -eo pgid=,stat= | awk -v g={pgid} '$1 == g && $2 !~ /^Z/' | grep -q ."


def _tail(name: str, follow: str, offset: int) -> str:
    """Print ``follow`` from byte ``offset`` and follow it until process group ``NAME.pid`` is
    gone (the caller then reads what was written after tail's last poll); a heartbeat on stderr
    lets the caller tell a quiet phase from a frozen link. A group not there yet counts as alive for
    the first ``_STARTUP_POLLS`` polls unless the process already wrote its status."""
    return (
        f"tail -c +{int(offset) + 1} -s {_FOLLOW_POLL_S} -F {shlex.quote(follow)} 2>/dev/null & t=$!; "
        f"g=$(cat {name}.pid); i=0; "
        f"while {_alive('$g')} || {{ [ ! -e {name}.status ] && [ $i -lt {_STARTUP_POLLS} ]; }}; "
        f"do sleep {_FOLLOW_POLL_S}; i=$((i + 1)); "
        f"[ $((i % {_HEARTBEAT_EVERY})) -eq 0 ] && echo heartbeat >&2; done; kill $t"
    )


def _ignore(line: str) -> None:
    """The follower's heartbeat on stderr is not the phase's output."""
