"""A managed inference server's life on its host (this machine or an SSH host, :class:`eagle3_pipeline.hosts.Host`).

- **start** (:meth:`ManagedServer.start`): refused while a server the pipeline started is running (a
  launch recorded but not yet ready with the same launch line is waited for instead: another run's, or
  one whose connection dropped), while anything listens on the port (the holder is named), or while the
  GPUs are not free (per-GPU ``memory.used`` over ``serving.gpu_free_mib``, the holders named:
  :mod:`.gpu_memory`); that reading is the baseline the stop comes back to. The launch line runs
  detached in a new session (``setsid``: its own process group, pgid = its pid), stdin from
  ``/dev/null``, stdout and stderr appended to the log behind a header line, in the shell environment
  ``serving.login_shell`` / ``env_file`` / ``env`` say. The pid file (JSON beside the log) is written by
  the launched shell itself **before** it execs the server (:data:`~.processes.LAUNCH_SCRIPT`): the pid,
  the process group, the start time (field 22 of ``/proc/<pid>/stat``, clock ticks since boot) and the
  boot id; once ready, the command line as ``/proc/<pid>/cmdline`` shows it and the group's processes.
  Ready = the health tick (:func:`eagle3_pipeline.health.run_health_tick`) passes ``server_process``,
  ``port`` and ``generation``; a server that exits first is reported with its log's tail, one that does
  not pass in ``startup_timeout_s`` is stopped and reported the same way.
- **stop** (:meth:`ManagedServer.stop`): only a process the pid file describes: before any signal,
  the live process must have the recorded pid, process group, start time, boot id and command line
  (a reused pid is refused, nothing signalled; after a reboot nothing of it can be alive: nothing is
  signalled, the pid file goes). SIGTERM to the leader alone (the engine drains and stops its workers),
  to the group after half of ``stop_grace_s``, SIGKILL after the rest; then **verified**: no process of
  the group left, the port free, ``nvidia-smi --query-compute-apps`` listing no pid of the server, every
  GPU's ``memory.used`` back to the start's baseline within ``gpu_release_tolerance_mib`` (waited for up
  to ``gpu_release_timeout_s``; skipped, and said so, with no GPUs declared; with GPUs declared and no
  nvidia-smi they fail). What is still held is named, with the figures, in :class:`StopNotVerifiedError`.
  When the leader is already gone, only the recorded processes (pid and start time) are signalled.
- **status** (:meth:`ManagedServer.status`): running, exited (crashed, killed, or the host rebooted),
  orphaned (leader gone, some of its processes left) or absent, from the pid file and ``/proc``.

A dropped SSH connection is reopened and the command sent again for up to ``serving.reconnect_timeout_s``
(never the launch: the pid file says whether it ran); a host that stays away (or was never reached) is one
:class:`HostUnreachableError`. Nothing is ever killed by name. Results are typed (:mod:`.outcomes`); the pid
file's record, the ``/proc`` view and the shell scripts are :mod:`.processes`', the errors :mod:`.errors`'.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import NoReturn, TypeVar

from eagle3_pipeline.health import HealthReport, Status, run_health_tick
from eagle3_pipeline.health.script import Section, run_shell_probes, section_failure
from eagle3_pipeline.hosts import (
    CommandResult,
    Host,
    HostConnectError,
    HostDisconnectedError,
    HostError,
    quote_args,
)
from eagle3_pipeline.hosts.private import PrivateStateError, env_file, read_private, write_private
from eagle3_pipeline.managed import gpu_memory
from eagle3_pipeline.managed.errors import (
    AlreadyRunningError,
    GpusBusyError,
    HostUnreachableError,
    ManagedServerError,
    NotOurProcessError,
    PortInUseError,
    StartupFailedError,
    StopNotVerifiedError,
)
from eagle3_pipeline.managed.launch import LaunchLine
from eagle3_pipeline.managed.outcomes import ServerStatus, StartResult, StopResult, StopVerification
from eagle3_pipeline.managed.processes import (
    GROUP_KILL_SCRIPT,
    GROUP_SCRIPT,
    LAUNCH_SCRIPT,
    NVIDIA_SMI,
    PIDS_KILL_SCRIPT,
    PROBE_TIMEOUT_S,
    GroupSnapshot,
    ProcessRef,
    ProcInfo,
    Seen,
    ServerRecord,
    in_shell_environment,
    parse_stat,
    port_check,
    port_holders,
    rebooted,
)
from eagle3_pipeline.managed.servers import ServerSetup

READY_CHECKS = ("server_process", "port", "generation")
LOG_TAIL_LINES = 40
COMMAND_TIMEOUT_S = 60.0
_T = TypeVar("_T")
LEADER_SHARE = 0.5  # of stop_grace_s: the leader's own shutdown, before the group is signalled


class ManagedServer:
    """One managed server on ``host`` (module doc). ``poll_s`` spaces the readiness ticks and the stop's checks."""

    poll_s = 1.0

    def __init__(self, host: Host, setup: ServerSetup) -> None:
        self.host = host
        self.setup = setup
        self.reconnects = 0  # SSH drops reopened, over this object's life
        self.reached = False  # a command reached the host: from then on a failed connection is a drop
        self._state_setting = f"{setup.setting}.log_dir"  # the setting a state folder's problem names

    # -- what is there ----------------------------------------------------------------------------

    @property
    def log_path(self) -> str:
        return self.setup.serving.log_path

    @property
    def pid_path(self) -> str:
        return self.setup.serving.pid_path

    @property
    def _where(self) -> str:
        return f"{self.setup.setting} on {self.host.name}"

    def _host_run(self, command: str, timeout_s: float, retry: bool = True) -> CommandResult:
        return self._reconnecting(lambda: self.host.run(command, timeout_s), retry)

    def _reconnecting(self, call: Callable[[], _T], retry: bool = True) -> _T:
        """``call`` (one host command); once the host was reached, a dropped SSH connection is reopened and it
        is sent again (``retry``) until ``serving.reconnect_timeout_s`` runs out, then it is a ManagedServerError;
        a host never reached raises its own HostError at once (the CLI's exit codes, the run's message)."""
        deadline: float | None = None
        while True:
            try:
                result = call()
                self.reached = True
                return result
            except HostError as exc:
                if not self.reached:
                    raise
                if not isinstance(exc, (HostConnectError, HostDisconnectedError)):
                    raise HostUnreachableError(f"{self._where}: cannot reach the host: {exc}", exc) from None
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.setup.serving.reconnect_timeout_s
                if not retry or now > deadline:
                    raise HostUnreachableError(
                        f"{self._where}: the connection to the host dropped and could not be reopened within "
                        f"{self.setup.serving.reconnect_timeout_s:g} s (serving.reconnect_timeout_s): {exc}",
                        exc,
                    ) from None
                self.reconnects += 1
                self.host.close()
                time.sleep(self.poll_s)

    def _run(self, command: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        result = self._host_run(command, timeout_s)
        if not result.ok:
            why = result.stderr.strip() or result.stdout.strip() or "no output"
            state = "timed out" if result.timed_out else f"exit {result.exit_code}"
            raise ManagedServerError(f"{self._where}: a host command failed ({state}): {why[:300]}")
        return result.stdout

    def read_record(self) -> ServerRecord | None:
        """The pid file, or None when there is none (read only from a private folder, never through a link)."""
        try:
            text = self._reconnecting(lambda: read_private(self.host, self.pid_path, self._state_setting))
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
            self._reconnecting(lambda: write_private(self.host, path, data.encode(), self._state_setting))
        except PrivateStateError as exc:
            raise ManagedServerError(f"{self._where}: {exc}") from None

    def _write_record(self, record: ServerRecord) -> None:
        self._write_private(self.pid_path, record.to_json() + "\n")

    def _remove_record(self) -> None:
        self._run(f"rm -f {shlex.quote(self.pid_path)}")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            result = self._host_run(quote_args("tail", "-n", str(lines), self.log_path), COMMAND_TIMEOUT_S)
        except ManagedServerError as exc:
            return f"(the log {self.log_path} could not be read: {exc})"
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
        if rebooted(record, snap):
            return f"the host rebooted since its start (boot id {snap.boot_id}, recorded {record.boot_id})"
        if leader is None or not leader.live:
            return f"pid {record.pid} is gone"
        differences = []
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
        live = {(p.pid, p.start_ticks) for p in snap.live_group() if not rebooted(record, snap)}
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
        if snap.leader is not None and snap.leader.live and not rebooted(record, snap):
            return ServerStatus("foreign", why, record)
        return ServerStatus("exited", f"the server started {record.started_at} has exited ({why})", record)

    # -- start ------------------------------------------------------------------------------------

    def _listeners(self) -> tuple[tuple[int, str], ...] | None:
        """Who listens on the port (None: ss could not tell)."""
        out = run_shell_probes(self.host, [("ss", ("ss", "-Htlnp"))], PROBE_TIMEOUT_S)
        section = out.sections.get("ss")
        if section is None or section_failure(section, "ss", PROBE_TIMEOUT_S) is not None:
            return None
        return port_holders(section.text, self.setup.port)

    def start(self, launch: LaunchLine, reason: str) -> StartResult:
        """Start the server for ``launch.purpose``, wait until the health tick calls it ready (module doc)."""
        started, reconnects = time.monotonic(), self.reconnects
        status = self.status()
        record, replaced = status.record, None
        adopted = status.state == "running" and record is not None and _unconfirmed_launch_of(record, launch)
        gpu_check = "skipped: a launch already recorded was waited for"
        if not adopted:
            replaced = self._refuse_start(status)
            baseline, gpu_check = self._gpus_free()
            record = self._launch(launch, reason, baseline)
        assert record is not None
        report = self.await_ready(record)
        record = self.read_record() or record
        return StartResult(
            server=self.setup.name,
            host=self.host.name,
            role=launch.purpose.role,
            reason=reason,
            pid=record.pid,
            port=self.setup.port,
            command=launch.display(),
            log_path=self.log_path,
            pid_path=self.pid_path,
            duration_s=time.monotonic() - started,
            members=record.members,
            report=report,
            replaced=replaced,
            gpu_check=gpu_check,
            reconnects=self.reconnects - reconnects,
            adopted=adopted,
        )

    def _refuse_start(self, status: ServerStatus) -> str | None:
        """Raise while a server of ours runs or left processes, or the port is held; else the stale pid
        file's state the start replaces (None: there was none)."""
        if status.state == "running":
            raise AlreadyRunningError(f"{self._where}: already running ({status.detail}); stop it first")
        if status.state == "orphaned":
            raise ManagedServerError(
                f"{self._where}: processes of the previous server are left ({status.detail}); stop it first"
            )
        holders = self._listeners()
        if holders:
            shown = ", ".join(f"pid {pid} ({name})" if pid else name for pid, name in holders)
            raise PortInUseError(
                f"{self._where}: port {self.setup.port} is already in use by {shown}; the pipeline did not start "
                f"that process and leaves it alone: stop it, or give {self.setup.setting}.port another port"
            )
        return status.detail if status.state in ("exited", "foreign") else None

    def await_ready(self, record: ServerRecord) -> HealthReport:
        """Wait until the recorded server passes the health tick (``startup_timeout_s`` from now), then record
        its command line and processes; one that exits or does not get ready is stopped and raised
        (:class:`StartupFailedError`). A dropped SSH connection is reopened meanwhile (module doc)."""
        seen = Seen({m.pid: m.start_ticks for m in record.members})
        deadline = time.monotonic() + self.setup.serving.startup_timeout_s
        spec = self.setup.server_spec()
        while True:
            snap = self._snapshot(record.pid, record.pgid)
            seen.add(p for p in snap.live_group() if not rebooted(record, snap))
            if self._identify(record, snap) is not None:
                self._fail_start(record, seen, "exited during start-up")
            report, _ = run_health_tick(self.host, spec, self.setup.thresholds)
            if _ready(report):
                self._remove_key()
                break
            if time.monotonic() > deadline:
                timeout = self.setup.serving.startup_timeout_s
                self._fail_start(record, seen, f"did not get ready within {timeout:g} s ({report.summary()})")
            time.sleep(self.poll_s)
        snap = self._snapshot(record.pid, record.pgid)
        seen.add(p for p in snap.live_group() if not rebooted(record, snap))
        ready_s = round((datetime.now(UTC) - datetime.fromisoformat(record.started_at)).total_seconds(), 3)
        self._write_record(replace(record, cmdline=snap.leader_cmdline, members=seen.refs(), ready_s=ready_s))
        return report

    def _write_key(self) -> None:
        """The engine's key file (``serving.api_key_env``): a private file written through stdin (0600)."""
        key = self.setup.api_key()
        if key is not None:
            self._write_private(self.setup.serving.key_path, f"api-key: {json.dumps(key)}\n")

    def _remove_key(self) -> None:
        """The key file goes once the engine has read it (a start reads it again from a fresh one)."""
        if self.setup.serving.api_key_env is not None:
            self._host_run(quote_args("rm", "-f", self.setup.serving.key_path), COMMAND_TIMEOUT_S)

    def _gpus_free(self) -> tuple[tuple[tuple[int, float], ...] | None, str]:
        """The per-GPU baseline before a start, and what was found; refused while the GPUs are not free after
        ``gpu_release_timeout_s`` (a crashed server's memory goes a little after its processes)."""
        if self.setup.expected_gpus == 0:
            return None, "skipped: health.expected_gpus is 0 (no GPUs declared)"
        deadline = time.monotonic() + self.setup.serving.gpu_release_timeout_s
        while True:
            out = run_shell_probes(self.host, gpu_memory.READING_SECTIONS, PROBE_TIMEOUT_S)
            reading = gpu_memory.parse_reading(out.sections, out.failure)
            if reading.unknown is not None:
                return None, f"unknown: could not measure the GPUs' memory: {reading.unknown}"
            busy = gpu_memory.busy_message(reading, self.setup)
            if not busy:
                break
            if time.monotonic() > deadline:
                raise GpusBusyError(f"{self._where}: {busy}")
            time.sleep(self.poll_s)
        used = ", ".join(f"{mib:.0f}" for _, mib in reading.used)
        return reading.used, f"ok: {len(reading.used)} GPU(s) free, MiB used: {used} (the baseline)"

    def _launch(self, launch: LaunchLine, reason: str, baseline: tuple[tuple[int, float], ...] | None) -> ServerRecord:
        """Launch detached; the launched shell writes the pid file before it execs (module doc). After a
        dropped connection the pid file says whether the launch ran; it is sent again only when it did not."""
        now = datetime.now(UTC).isoformat(timespec="seconds")
        header = f"=== {now} eagle3-pipeline starts the {launch.purpose.role} server ({reason}): {launch.display()}"
        serving = self.setup.serving
        # The env's values reach the server through a 0600 file it sources, never its command line.
        self._write_private(serving.env_path, env_file(launch.env).decode())
        self._write_key()
        command = in_shell_environment(list(launch.argv), serving.login_shell, (serving.env_file, serving.env_path))
        pending = ServerRecord(
            pid=0,
            pgid=0,
            start_ticks=0,
            boot_id="",
            argv=launch.argv,
            env_names=tuple(sorted(launch.env)),
            engine=self.setup.engine,
            port=self.setup.port,
            role=launch.purpose.role,
            reason=reason,
            started_at=now,
            log_path=self.log_path,
            gpu_baseline=baseline,
        )
        body = pending.launch_body()
        script = quote_args("sh", "-c", LAUNCH_SCRIPT, "sh", self.log_path, self.pid_path, header, body)
        deadline = time.monotonic() + serving.reconnect_timeout_s
        while True:
            try:
                result = self._host_run(f"{script} {quote_args(*command)}", COMMAND_TIMEOUT_S, retry=False)
            except HostUnreachableError as exc:
                if not isinstance(exc.cause, (HostConnectError, HostDisconnectedError)) or time.monotonic() > deadline:
                    raise
                self.reconnects += 1
                self.host.close()
                time.sleep(self.poll_s)
                recorded = self._launched(pending)
                if recorded is not None:
                    return recorded
                continue
            if not result.ok:
                self._remove_key()
                why = result.stderr.strip() or result.stdout.strip() or "no output"
                raise ManagedServerError(f"{self._where}: the launch failed (exit {result.exit_code}): {why[:300]}")
            text = next((line[7:] for line in result.stdout.splitlines() if line.startswith("record ")), "")
            return ServerRecord.from_json(text)

    def _launched(self, pending: ServerRecord) -> ServerRecord | None:
        """The pid file of ``pending``'s launch, if it ran (None: no record of it, or the host is still away)."""
        try:
            record = self.read_record()
        except ManagedServerError:
            return None
        ours = record is not None and (record.started_at, record.reason) == (pending.started_at, pending.reason)
        return record if ours and record is not None and record.argv == pending.argv else None

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
            verification = self._verify((), {}, None)
            return self._stopped(None, reason, (), started, verification)
        snap = self._snapshot(record.pid, record.pgid)
        why = self._identify(record, snap)
        seen = Seen({m.pid: m.start_ticks for m in record.members})
        if rebooted(record, snap):
            seen, signals = Seen(), []  # nothing of a server started before the reboot is alive
        elif why is None:
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
        verification = self._verify(seen.refs(), dict(seen.processes), record.gpu_baseline)
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
            server=self.setup.name,
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

    def _group_alive(self, record: ServerRecord) -> list[ProcInfo]:
        return [p for p in self._snapshot(record.pid, record.pgid).live_group() if p.pgid == record.pgid]

    def _signal_group(self, record: ServerRecord) -> list[str]:
        """SIGTERM to the leader alone (the engine stops its workers), after ``LEADER_SHARE`` of the grace to the
        group, then SIGKILL; with the leader gone, to each process left (pid and start time checked)."""
        grace, ticks = self.setup.serving.stop_grace_s, str(record.start_ticks)
        steps = (("TERM", grace * LEADER_SHARE), ("TERM group", grace * (1 - LEADER_SHARE)), ("KILL", 10.0))
        signals = []
        for name, wait_s in steps:
            if not (left := self._group_alive(record)):
                break
            signals.append(name)
            if name == "TERM":
                self._run(quote_args("sh", "-c", PIDS_KILL_SCRIPT, "sh", "TERM", str(record.pid), ticks))
            elif any(p.pid == record.pid for p in left):
                self._run(quote_args("sh", "-c", GROUP_KILL_SCRIPT, "sh", name[:4], str(record.pgid), ticks))
            else:
                pairs = [str(v) for p in left for v in (p.pid, p.start_ticks)]
                self._run(quote_args("sh", "-c", PIDS_KILL_SCRIPT, "sh", name[:4], *pairs))
            deadline = time.monotonic() + wait_s
            while self._group_alive(record) and time.monotonic() < deadline:
                time.sleep(min(self.poll_s, 0.2))
        return signals

    def _signal_processes(self, processes: Sequence[ProcessRef]) -> list[str]:
        """The leader is gone: SIGTERM each recorded process still alive, SIGKILL what is left."""
        signals: list[str] = []
        pending = list(processes)
        for signal, wait_s in (("TERM", self.setup.serving.stop_grace_s), ("KILL", 10.0)):
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

    def _verify(
        self, processes: Sequence[ProcessRef], pids: Mapping[int, int], baseline: Sequence[tuple[int, float]] | None
    ) -> StopVerification:
        """Processes, port and GPUs after the signals; GPU memory is given ``gpu_release_timeout_s`` to go."""
        deadline = time.monotonic() + self.setup.serving.gpu_release_timeout_s
        while True:
            left = tuple(self._still_alive(processes)) if processes else ()
            sections: list[Section] = [("ss", ("ss", "-Htlnp")), ("gpu", NVIDIA_SMI), gpu_memory.GPU_SECTION]
            out = run_shell_probes(self.host, sections, PROBE_TIMEOUT_S)
            port = port_check(out.sections.get("ss"), self.setup.port, out.failure)
            gpu_holders, gpu_check = gpu_memory.pid_check(out.sections.get("gpu"), pids, self.setup, out.failure)
            memory, memory_check = gpu_memory.release_check(
                out.sections.get("gpus"), bool(pids), baseline, self.setup, out.failure
            )
            verification = StopVerification(left, self.setup.port, port, gpu_holders, gpu_check, memory, memory_check)
            if verification.ok or time.monotonic() > deadline:
                return verification
            time.sleep(self.poll_s)


def _unconfirmed_launch_of(record: ServerRecord, launch: LaunchLine) -> bool:
    """A running server recorded at its launch but not yet ready (no command line recorded), for this launch line."""
    return record.cmdline is None and tuple(record.argv) == tuple(launch.argv)


def _ready(report: HealthReport) -> bool:
    statuses = {check.name: check.status for check in report.checks}
    return all(statuses.get(name) == Status.OK for name in READY_CHECKS)
