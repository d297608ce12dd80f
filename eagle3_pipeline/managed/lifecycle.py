"""A managed inference server's life on its host (this machine or an SSH host, :class:`eagle3_pipeline.hosts.Host`).

- **start** (:meth:`ManagedServer.start`): refused while a server the pipeline started is running, or
  while anything listens on the port (the holder is named). The launch line runs detached in a new
  session (``setsid``: its own process group, pgid = its pid), stdin from ``/dev/null``, stdout and
  stderr appended to the log behind a header line. The pid file (JSON beside the log) records the pid,
  the process group, the process's start time (field 22 of ``/proc/<pid>/stat``, clock ticks since
  boot), the boot id, and — once ready — its command line as ``/proc/<pid>/cmdline`` shows it, with the
  group's processes seen so far. Ready = the health tick (:func:`eagle3_pipeline.health.run_health_tick`)
  passes ``server_process``, ``port`` and ``generation``; a server that exits first is reported with
  its log's tail, one that does not pass in ``startup_timeout_s`` is stopped and reported the same way.
- **stop** (:meth:`ManagedServer.stop`): only a process the pid file describes: before any signal,
  the live process must have the recorded pid, process group, start time, boot id and command line
  (a reused pid is refused with a message, nothing signalled). Then SIGTERM to the group, SIGKILL after
  ``stop_grace_s``, and the stop is **verified**: no process of the group left, nothing listening on
  the port, and ``nvidia-smi --query-compute-apps=pid,used_memory`` listing no pid of the server (on a
  host without nvidia-smi and ``expected_gpus`` 0 that check is skipped, and said so). Anything still
  held is named in :class:`StopNotVerifiedError`. When the group's leader is already gone, only the
  processes recorded as the server's (pid and start time) are signalled.
- **status** (:meth:`ManagedServer.status`): running, exited (crashed or killed), orphaned (leader gone,
  some of its processes left) or absent, from the pid file and ``/proc``.

Nothing is ever killed by name. The results (:class:`StartResult`, :class:`StopResult`) are typed, with
their durations and reasons, for the Dagster layer's events and observations (:mod:`.outcomes`); the pid
file's record, the ``/proc`` view and the shell scripts are :mod:`.processes`'.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import NoReturn

from eagle3_pipeline.health import HealthReport, Status, run_health_tick
from eagle3_pipeline.health.script import Section, SectionOutput, run_shell_probes, section_failure
from eagle3_pipeline.hosts import Host, quote_args
from eagle3_pipeline.hosts.private import PrivateStateError, env_file, read_private, write_private
from eagle3_pipeline.managed.launch import LaunchLine
from eagle3_pipeline.managed.outcomes import ServerStatus, StartResult, StopResult, StopVerification
from eagle3_pipeline.managed.plan import ManagedServerPlan
from eagle3_pipeline.managed.processes import (
    GROUP_KILL_SCRIPT,
    GROUP_SCRIPT,
    LAUNCH_SCRIPT,
    NVIDIA_SMI,
    PIDS_KILL_SCRIPT,
    PROBE_TIMEOUT_S,
    GroupSnapshot,
    ProcessRef,
    Seen,
    ServerRecord,
    parse_stat,
    port_check,
    port_holders,
)

READY_CHECKS = ("server_process", "port", "generation")
LOG_TAIL_LINES = 40
COMMAND_TIMEOUT_S = 60.0


class ManagedServerError(RuntimeError):
    """A managed server could not be started, identified or stopped; the message says what and where."""


class AlreadyRunningError(ManagedServerError):
    """A server the pipeline started is running already."""


class PortInUseError(ManagedServerError):
    """Something listens on the server's port already (named in the message)."""


class StartupFailedError(ManagedServerError):
    """The server exited during start-up, or did not get ready in time; the message carries its log's tail."""

    def __init__(self, message: str, log_tail: str, stop: StopResult | None = None) -> None:
        super().__init__(message)
        self.log_tail = log_tail
        self.stop = stop


class NotOurProcessError(ManagedServerError):
    """The pid file names a live process that is not the one the pipeline started: nothing was signalled."""


class StopNotVerifiedError(ManagedServerError):
    """Signals were sent, but a process, the port or GPU memory is still held (named in the message)."""

    def __init__(self, message: str, result: StopResult) -> None:
        super().__init__(message)
        self.result = result


class ManagedServer:
    """One managed server on ``host`` (module doc). ``poll_s`` spaces the readiness ticks and the stop's checks."""

    poll_s = 1.0

    def __init__(self, host: Host, plan: ManagedServerPlan) -> None:
        self.host = host
        self.plan = plan

    # -- what is there ----------------------------------------------------------------------------

    @property
    def log_path(self) -> str:
        return self.plan.serving.log_path

    @property
    def pid_path(self) -> str:
        return self.plan.serving.pid_path

    @property
    def _where(self) -> str:
        return f"{self.plan.setting} on {self.host.name}"

    def _run(self, command: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        result = self.host.run(command, timeout_s)
        if not result.ok:
            why = result.stderr.strip() or result.stdout.strip() or "no output"
            state = "timed out" if result.timed_out else f"exit {result.exit_code}"
            raise ManagedServerError(f"{self._where}: a host command failed ({state}): {why[:300]}")
        return result.stdout

    @property
    def _state_setting(self) -> str:
        return f"{self.plan.setting}.log_dir"

    def read_record(self) -> ServerRecord | None:
        """The pid file, or None when there is none (read only from a private folder, never through a link)."""
        try:
            text = read_private(self.host, self.pid_path, self._state_setting)
        except PrivateStateError as exc:
            raise ManagedServerError(f"{self._where}: {exc}; nothing was signalled") from None
        if text is None or not text.strip():
            return None
        try:
            return ServerRecord.from_json(text)
        except (ValueError, KeyError, TypeError) as exc:
            raise ManagedServerError(
                f"{self._where}: the pid file {self.pid_path} is not a record this pipeline wrote ({exc}); "
                "nothing was signalled"
            ) from None

    def _write_private(self, path: str, data: str) -> None:
        try:
            write_private(self.host, path, data.encode(), self._state_setting)
        except PrivateStateError as exc:
            raise ManagedServerError(f"{self._where}: {exc}") from None

    def _write_record(self, record: ServerRecord) -> None:
        self._write_private(self.pid_path, record.to_json() + "\n")

    def _remove_record(self) -> None:
        self._run(f"rm -f {shlex.quote(self.pid_path)}")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        result = self.host.run(quote_args("tail", "-n", str(lines), self.log_path), COMMAND_TIMEOUT_S)
        return result.stdout.rstrip("\n") if result.ok else f"(no log at {self.log_path})"

    def _snapshot(self, pid: int, pgid: int) -> GroupSnapshot:
        out = self._run(quote_args("sh", "-c", GROUP_SCRIPT, "sh", str(pid), str(pgid)), PROBE_TIMEOUT_S)
        boot, leader, cmdline, group = "", None, None, []
        for line in out.splitlines():
            kind, _, value = line.partition(" ")
            if kind == "boot":
                boot = value.strip()
            elif kind == "leader":
                leader = parse_stat(value)
            elif kind == "cmdline" and leader is not None:
                raw = bytes.fromhex(value.strip())
                cmdline = tuple(part.decode(errors="replace") for part in raw.split(b"\0")[:-1])
            elif kind == "member":
                group.append(parse_stat(value))
        return GroupSnapshot(boot, leader, cmdline, tuple(group))

    def _identify(self, record: ServerRecord, snap: GroupSnapshot) -> str | None:
        """None when the snapshot's leader is the recorded process; else why it is not (gone or another)."""
        leader = snap.leader
        if leader is None or not leader.live:
            return f"pid {record.pid} is gone"
        differences = []
        if snap.boot_id != record.boot_id:
            differences.append(f"the host rebooted (boot id {snap.boot_id}, recorded {record.boot_id})")
        if leader.start_ticks != record.start_ticks:
            differences.append(f"start time {leader.start_ticks} ticks, recorded {record.start_ticks}")
        if leader.pgid != record.pgid:
            differences.append(f"process group {leader.pgid}, recorded {record.pgid}")
        if record.cmdline is not None and snap.leader_cmdline != record.cmdline:
            shown = shlex.join(snap.leader_cmdline or ())[:200]
            differences.append(f"command {shown!r}, recorded {shlex.join(record.cmdline)[:200]!r}")
        return None if not differences else f"pid {record.pid} is another process: " + "; ".join(differences)

    def _recorded_alive(self, record: ServerRecord, snap: GroupSnapshot) -> list[ProcessRef]:
        """The recorded processes still alive with their recorded start times (the leader aside)."""
        live = {(p.pid, p.start_ticks) for p in snap.live_group() if snap.boot_id == record.boot_id}
        return [m for m in record.members if (m.pid, m.start_ticks) in live and m.pid != record.pid]

    def status(self) -> ServerStatus:
        """What the pid file and the host's ``/proc`` say about the server (see :class:`ServerStatus`). A
        running server's processes not yet in the pid file are recorded, so that they can be stopped
        should its leader die."""
        record = self.read_record()
        if record is None:
            return ServerStatus("absent", f"no pid file at {self.pid_path}")
        snap = self._snapshot(record.pid, record.pgid)
        why = self._identify(record, snap)
        if why is None:
            live = tuple(ProcessRef(p.pid, p.start_ticks) for p in snap.live_group())
            if not set(live) <= set(record.members):
                record = replace(record, members=tuple(sorted(set(record.members) | set(live), key=lambda m: m.pid)))
                self._write_record(record)
            return ServerStatus("running", f"{record.engine} pid {record.pid} on port {record.port}", record, live)
        alive = tuple(self._recorded_alive(record, snap))
        if alive:
            shown = ", ".join(str(p.pid) for p in alive)
            return ServerStatus("orphaned", f"{why}; its processes {shown} are left", record, alive)
        if snap.leader is not None and snap.leader.live:
            return ServerStatus("foreign", why, record)
        return ServerStatus("exited", f"the server started {record.started_at} has exited ({why})", record)

    # -- start ------------------------------------------------------------------------------------

    def _listeners(self) -> tuple[tuple[int, str], ...] | None:
        """Who listens on the port (None: ss could not tell)."""
        out = run_shell_probes(self.host, [("ss", ("ss", "-Htlnp"))], PROBE_TIMEOUT_S)
        section = out.sections.get("ss")
        if section is None or section_failure(section, "ss", PROBE_TIMEOUT_S) is not None:
            return None
        return port_holders(section.text, self.plan.port)

    def start(self, launch: LaunchLine, reason: str) -> StartResult:
        """Start the server for ``launch.purpose``, wait until the health tick calls it ready (module doc)."""
        started = time.monotonic()
        status = self.status()
        if status.state == "running":
            raise AlreadyRunningError(f"{self._where}: already running ({status.detail}); stop it first")
        if status.state == "orphaned":
            raise ManagedServerError(
                f"{self._where}: processes of the previous server are left ({status.detail}); stop it first"
            )
        replaced = status.detail if status.state in ("exited", "foreign") else None
        holders = self._listeners()
        if holders:
            shown = ", ".join(f"pid {pid} ({name})" if pid else name for pid, name in holders)
            raise PortInUseError(
                f"{self._where}: port {self.plan.port} is already in use by {shown}; the pipeline did not start "
                f"that process and leaves it alone: stop it, or give {self.plan.setting}.port another port"
            )
        record = self._launch(launch, reason)
        seen = Seen({record.pid: record.start_ticks})
        deadline = time.monotonic() + self.plan.serving.startup_timeout_s
        spec = self.plan.server_spec()
        report: HealthReport | None = None
        while True:
            snap = self._snapshot(record.pid, record.pgid)
            seen.add(p for p in snap.live_group() if snap.boot_id == record.boot_id)
            if self._identify(record, snap) is not None:
                self._fail_start(record, seen, "exited during start-up")
            report, _ = run_health_tick(self.host, spec, self.plan.thresholds)
            if _ready(report):
                break
            if time.monotonic() > deadline:
                summary = report.summary() if report is not None else "no health tick"
                self._fail_start(
                    record, seen, f"did not get ready within {self.plan.serving.startup_timeout_s:g} s ({summary})"
                )
            time.sleep(self.poll_s)
        self._remove_key()
        snap = self._snapshot(record.pid, record.pgid)
        seen.add(p for p in snap.live_group() if snap.boot_id == record.boot_id)
        ready_s = round(time.monotonic() - started, 3)
        record = replace(record, cmdline=snap.leader_cmdline, members=seen.refs(), ready_s=ready_s)
        self._write_record(record)
        return StartResult(
            server=self.plan.name,
            host=self.host.name,
            role=launch.purpose.role,
            reason=reason,
            pid=record.pid,
            port=self.plan.port,
            command=launch.display(),
            log_path=self.log_path,
            pid_path=self.pid_path,
            duration_s=time.monotonic() - started,
            members=record.members,
            report=report,
            replaced=replaced,
        )

    def _write_key(self) -> None:
        """The engine's key file (``serving.api_key_env``): a private file written through stdin (0600)."""
        key = self.plan.api_key()
        if key is not None:
            self._write_private(self.plan.serving.key_path, f"api-key: {json.dumps(key)}\n")

    def _remove_key(self) -> None:
        """The key file goes once the engine has read it (a start reads it again from a fresh one)."""
        if self.plan.serving.api_key_env is not None:
            self.host.run(quote_args("rm", "-f", self.plan.serving.key_path), COMMAND_TIMEOUT_S)

    def _launch(self, launch: LaunchLine, reason: str) -> ServerRecord:
        self._write_key()
        now = datetime.now(UTC).isoformat(timespec="seconds")
        header = f"=== {now} eagle3-pipeline starts the {launch.purpose.role} server ({reason}): {launch.display()}"
        # The env's values reach the server through a 0600 file it sources, never its command line.
        env_path = self.plan.serving.env_path
        self._write_private(env_path, env_file(launch.env).decode())
        command = ["sh", "-c", '. "$0" && exec "$@"', env_path, *launch.argv]
        tmp = f"{self.pid_path}.launch"
        out = self._run(quote_args("sh", "-c", LAUNCH_SCRIPT, "sh", self.log_path, tmp, header, *command))
        values: dict[str, str] = {}
        for line in out.splitlines():
            key, _, value = line.partition(" ")
            values[key] = value
        pid = int(values["pid"])
        if "stat" not in values:
            self._remove_key()
            tail = self.log_tail()
            raise StartupFailedError(
                f"{self._where}: the {launch.purpose.role} server (pid {pid}) exited at once; "
                f"log {self.log_path}:\n{tail}",
                tail,
            )
        info = parse_stat(values["stat"])
        record = ServerRecord(
            pid=pid,
            pgid=info.pgid,
            start_ticks=info.start_ticks,
            boot_id=values.get("boot", "").strip(),
            argv=launch.argv,
            env_names=tuple(sorted(launch.env)),
            engine=self.plan.engine,
            port=self.plan.port,
            role=launch.purpose.role,
            reason=reason,
            started_at=now,
            log_path=self.log_path,
            members=(ProcessRef(pid, info.start_ticks),),
        )
        self._write_record(record)
        return record

    def _fail_start(self, record: ServerRecord, seen: Seen, what: str) -> NoReturn:
        """Stop what is left of a start that failed (its recorded processes only), then raise with the log."""
        self._remove_key()
        record = replace(record, members=seen.refs())
        self._write_record(record)
        stop: StopResult | None = None
        stop_problem = ""
        try:
            stop = self.stop(f"start-up failed: {what}")
        except StopNotVerifiedError as exc:
            stop, stop_problem = exc.result, f"\nand its stop is not verified: {exc}"
        tail = self.log_tail()
        raise StartupFailedError(
            f"{self._where}: the {record.role} server (pid {record.pid}) {what}{stop_problem}; "
            f"log {self.log_path}:\n{tail}",
            tail,
            stop,
        )

    # -- stop -------------------------------------------------------------------------------------

    def stop(self, reason: str) -> StopResult:
        """Stop the server the pid file records, and verify it (module doc)."""
        started = time.monotonic()
        record = self.read_record()
        if record is None:
            verification = self._verify((), {})
            return self._stopped(None, reason, (), started, verification)
        snap = self._snapshot(record.pid, record.pgid)
        why = self._identify(record, snap)
        seen = Seen({m.pid: m.start_ticks for m in record.members})
        if why is None:
            seen.add(p for p in snap.live_group())
            signals = self._signal_group(record)
        else:
            alive = self._recorded_alive(record, snap)
            if snap.leader is not None and snap.leader.live and not alive:
                raise NotOurProcessError(
                    f"{self._where}: refusing to stop pid {record.pid}: the pid file {self.pid_path} records the "
                    f"{record.engine} server started {record.started_at} (pid {record.pid}, process group "
                    f"{record.pgid}, start time {record.start_ticks} ticks, command "
                    f"{shlex.join(record.cmdline or record.argv)[:200]!r}), but {why}. The pipeline did not start "
                    "it, so nothing was signalled; the server it started is gone: remove the pid file if that is "
                    "expected"
                )
            signals = self._signal_processes(alive)
        verification = self._verify(seen.refs(), dict(seen.processes))
        result = self._stopped(record, reason, signals, started, verification)
        if not verification.processes_left:
            self._remove_record()
        if not verification.ok:
            raise StopNotVerifiedError(
                f"{self._where}: the stop of the {record.engine} server (pid {record.pid}, port {record.port}) "
                f"is not verified after {result.duration_s:.1f} s: " + "; ".join(verification.problems()),
                result,
            )
        return result

    def _stopped(
        self,
        record: ServerRecord | None,
        reason: str,
        signals: Sequence[str],
        started: float,
        verification: StopVerification,
    ) -> StopResult:
        result = StopResult(
            server=self.plan.name,
            host=self.host.name,
            reason=reason,
            was_running=bool(signals),
            pid=record.pid if record else None,
            role=record.role if record else None,
            signals=tuple(signals),
            duration_s=time.monotonic() - started,
            verification=verification,
        )
        if record is None and not verification.ok:
            raise StopNotVerifiedError(
                f"{self._where}: no server of the pipeline's is running (no pid file at {self.pid_path}), but "
                + "; ".join(verification.problems())
                + ": the pipeline did not start that, so nothing was signalled",
                result,
            )
        return result

    def _group_alive(self, record: ServerRecord) -> bool:
        snap = self._snapshot(record.pid, record.pgid)
        return any(p.pgid == record.pgid for p in snap.live_group())

    def _signal_group(self, record: ServerRecord) -> list[str]:
        """SIGTERM the group while its leader is ours; SIGKILL what is left after the grace period."""
        signals = []
        for signal, wait_s in (("TERM", self.plan.serving.stop_grace_s), ("KILL", 10.0)):
            if not self._group_alive(record):
                break
            signals.append(signal)
            self._run(
                quote_args("sh", "-c", GROUP_KILL_SCRIPT, "sh", signal, str(record.pgid), str(record.start_ticks))
            )
            deadline = time.monotonic() + wait_s
            while self._group_alive(record) and time.monotonic() < deadline:
                time.sleep(min(self.poll_s, 0.2))
        return signals

    def _signal_processes(self, processes: Sequence[ProcessRef]) -> list[str]:
        """The leader is gone: SIGTERM each recorded process still alive, SIGKILL what is left."""
        signals: list[str] = []
        pending = list(processes)
        for signal, wait_s in (("TERM", self.plan.serving.stop_grace_s), ("KILL", 10.0)):
            if not pending:
                break
            signals.append(signal)
            pairs = [str(v) for p in pending for v in (p.pid, p.start_ticks)]
            self._run(quote_args("sh", "-c", PIDS_KILL_SCRIPT, "sh", signal, *pairs))
            deadline = time.monotonic() + wait_s
            while pending and time.monotonic() < deadline:
                pending = self._still_alive(pending)
                if pending:
                    time.sleep(min(self.poll_s, 0.2))
        return signals

    def _still_alive(self, processes: Sequence[ProcessRef]) -> list[ProcessRef]:
        pairs = [str(v) for p in processes for v in (p.pid, p.start_ticks)]
        script = (
            'while [ $# -ge 2 ]; do s=$(cat "/proc/$1/stat" 2>/dev/null) && printf \'%s\\n\' "$s"; shift 2; done; '
            "exit 0"
        )
        out = self._run(quote_args("sh", "-c", script, "sh", *pairs), PROBE_TIMEOUT_S)
        live = {(p.pid, p.start_ticks) for p in map(parse_stat, out.splitlines()) if p.live}
        return [p for p in processes if (p.pid, p.start_ticks) in live]

    def _verify(self, processes: Sequence[ProcessRef], pids: Mapping[int, int]) -> StopVerification:
        """Processes, port and GPUs after the signals; GPU memory is given ``gpu_release_timeout_s`` to go."""
        deadline = time.monotonic() + self.plan.serving.gpu_release_timeout_s
        while True:
            left = tuple(self._still_alive(processes)) if processes else ()
            sections: list[Section] = [("ss", ("ss", "-Htlnp")), ("gpu", NVIDIA_SMI)]
            out = run_shell_probes(self.host, sections, PROBE_TIMEOUT_S)
            port = port_check(out.sections.get("ss"), self.plan.port, out.failure)
            gpu_holders, gpu_check = self._gpu_check(out.sections.get("gpu"), pids, out.failure)
            verification = StopVerification(left, self.plan.port, port, gpu_holders, gpu_check)
            if verification.ok or time.monotonic() > deadline:
                return verification
            time.sleep(self.poll_s)

    def _gpu_check(
        self, section: SectionOutput | None, pids: Mapping[int, int], missing: str
    ) -> tuple[tuple[tuple[int, int], ...], str]:
        if not pids:
            return (), "skipped: no process of the server to look for"
        if section is None:
            return (), f"failed: cannot verify the GPUs ({missing})"
        if section.exit_code == 127:
            if self.plan.expected_gpus == 0:
                return (), "skipped: no nvidia-smi on the host and health.expected_gpus is 0"
            return (), (
                f"failed: cannot verify the GPUs: no nvidia-smi on the host, which should have "
                f"{self.plan.expected_gpus} (health.expected_gpus)"
            )
        failure = section_failure(section, "nvidia-smi --query-compute-apps", PROBE_TIMEOUT_S)
        if failure is not None:
            return (), f"failed: cannot verify the GPUs: {failure.detail}"
        held = []
        for line in section.text.splitlines():
            parts = [part.strip() for part in line.split(",")]
            if len(parts) >= 2 and parts[0].isdigit() and int(parts[0]) in pids:
                held.append((int(parts[0]), int(parts[1]) if parts[1].isdigit() else 0))
        apps = sum(1 for line in section.text.splitlines() if line.strip())
        return tuple(held), f"ok: nvidia-smi lists {apps} compute process(es), none of the server's"


def _ready(report: HealthReport) -> bool:
    statuses = {check.name: check.status for check in report.checks}
    return all(statuses.get(name) == Status.OK for name in READY_CHECKS)
