"""A host reached over SSH with paramiko: one connection reused across commands, host keys verified
against known_hosts, key file then agent keys, streaming and file transfer; bounded by deadlines."""

from __future__ import annotations

import base64
import contextlib
import getpass
import hashlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paramiko
from paramiko.pkey import UnknownKeyType

from eagle3_pipeline.hosts.host import (
    CommandResult,
    Host,
    HostAuthError,
    HostConnectError,
    HostDisconnectedError,
    HostKeyError,
    text,
)

_CHUNK = 1 << 16
_POLL_S = 0.2
# Not settings of the pipeline file: how long the server may take to accept our credentials, and how
# often an idle connection is kept alive.
AUTH_TIMEOUT_S = 10.0
KEEPALIVE_S = 15


def host_key_fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style SHA256 fingerprint of a public key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class SshHost(Host):
    """A host reached over SSH with paramiko; one connection, reused across commands.

    The keyword arguments named as `HostConfig`'s fields are that section's, with no default here
    (:func:`eagle3_pipeline.hosts.build_host`). Authentication: the private key file `key_file`, then
    the SSH agent's keys (`allow_agent`, key file or not). An encrypted key file is decrypted with
    `passphrase`, or with the value of the environment variable `key_passphrase_env`, read when
    connecting; neither is ever put in a message. Host keys are verified
    against `known_hosts`; an unknown or changed key raises `HostKeyError`. With
    `trust_on_first_use=True` an unknown key is accepted once and appended to `known_hosts`; a
    changed key is still refused.

    `connect_timeout_s` bounds TCP connect, banner and key exchange, `auth_timeout_s` the
    authentication; `run(..., timeout_s)` bounds the whole call, reconnecting included. A command
    that times out is abandoned (its channel closed); the remote process gets SIGPIPE on its next
    write, so wrap long remote commands in `timeout N` when they must die promptly.
    """

    def __init__(
        self,
        hostname: str,
        *,
        port: int,
        username: str | None,
        key_file: str | os.PathLike[str] | None,
        key_passphrase_env: str | None,
        allow_agent: bool,
        known_hosts: str | os.PathLike[str],
        trust_on_first_use: bool,
        connect_timeout_s: float,
        passphrase: str | None = None,
        auth_timeout_s: float = AUTH_TIMEOUT_S,
        keepalive_s: int = KEEPALIVE_S,
        name: str | None = None,
    ) -> None:
        self.hostname = hostname
        self.port = port
        self.username = username or getpass.getuser()
        self.name = name or (hostname if port == 22 else f"{hostname}:{port}")
        self._key_filename = Path(key_file).expanduser() if key_file is not None else None
        self._passphrase = passphrase
        self._passphrase_env = key_passphrase_env
        self._use_agent = allow_agent
        self._known_hosts = Path(known_hosts).expanduser()
        self._trust_on_first_use = trust_on_first_use
        self._connect_timeout_s = connect_timeout_s
        self._auth_timeout_s = auth_timeout_s
        self._keepalive_s = keepalive_s
        self._transport: paramiko.Transport | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SshHost({self._where})"

    @property
    def _where(self) -> str:
        return f"{self.username}@{self.hostname}:{self.port}"

    @property
    def _host_key_name(self) -> str:
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    @property
    def _unreachable_fix(self) -> str:
        return "check the host's hostname and port, and that it is up and reachable from here"

    @property
    def _keyscan(self) -> str:
        port = "" if self.port == 22 else f"-p {self.port} "
        return f"ssh-keyscan {port}{self.hostname} >> {self._known_hosts}"

    def run(self, command: str, timeout_s: float, stdin: bytes = b"") -> CommandResult:
        started = time.monotonic()
        deadline = started + timeout_s
        channel = self._open_channel(deadline)
        return self._execute(channel, command, started, deadline, stdin)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def open_forward(self, remote: tuple[str, int], origin: tuple[str, int], timeout_s: float) -> paramiko.Channel:
        """A ``direct-tcpip`` channel to ``remote`` as the host sees it (what ``ssh -L`` opens per connection),
        on this host's connection, reconnecting once when it dropped. HostConnectError when the host refuses it
        (nothing listens there, or its sshd forbids forwarding)."""
        deadline = time.monotonic() + timeout_s
        retried = False
        while True:
            transport, fresh = self._live_transport(deadline)
            try:
                return transport.open_channel("direct-tcpip", remote, origin, timeout=_remaining(deadline))
            except paramiko.ChannelException as exc:
                raise HostConnectError(
                    f"{self._where} refused a forward to {remote[0]}:{remote[1]} ({exc.text}): is the server "
                    "listening there, and does the host's sshd allow TCP forwarding (AllowTcpForwarding)?"
                ) from None
            except (paramiko.SSHException, OSError, EOFError) as exc:
                transport.close()
                if fresh or retried or _remaining(deadline) == 0:
                    raise HostConnectError(f"cannot open a forward on {self._where}: {exc}") from None
                retried = True

    # -- connection -------------------------------------------------------------------------

    def _open_channel(self, deadline: float) -> paramiko.Channel:
        """A session channel; a reused connection that fails is dropped and replaced once."""
        transport, fresh = self._live_transport(deadline)
        try:
            return transport.open_session(timeout=_remaining(deadline))
        except (paramiko.SSHException, OSError, EOFError) as exc:
            transport.close()  # the next `_live_transport` sees it inactive and reconnects
            if fresh or _remaining(deadline) == 0:
                raise HostConnectError(f"cannot open a session on {self._where}: {exc}") from None
        transport, _ = self._live_transport(deadline)
        try:
            return transport.open_session(timeout=_remaining(deadline))
        except (paramiko.SSHException, OSError, EOFError) as exc:
            transport.close()
            raise HostConnectError(f"cannot open a session on {self._where}: {exc}") from None

    def _live_transport(self, deadline: float) -> tuple[paramiko.Transport, bool]:
        if not self._lock.acquire(timeout=_remaining(deadline)):
            raise HostConnectError(f"timed out waiting for the connection to {self._where}")
        try:
            if self._transport is not None and self._transport.is_active():
                return self._transport, False
            self._drop()
            self._transport = self._connect(deadline)
            return self._transport, True
        finally:
            self._lock.release()

    def _drop(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def _connect(self, deadline: float) -> paramiko.Transport:
        sock = self._tcp_connect(deadline)
        transport = paramiko.Transport(sock)
        try:
            self._prefer_known_key_types(transport)
            self._verify_host_key(self._handshake(transport, deadline))
            self._authenticate(transport, deadline)
        except BaseException:
            transport.close()
            raise
        transport.set_keepalive(self._keepalive_s)
        return transport

    def _tcp_connect(self, deadline: float) -> socket.socket:
        timeout = min(self._connect_timeout_s, _remaining(deadline))
        try:
            return socket.create_connection((self.hostname, self.port), timeout=timeout)
        except TimeoutError:
            raise HostConnectError(
                f"timed out connecting to {self._where} after {timeout:.0f} s; {self._unreachable_fix}"
            ) from None
        except OSError as exc:
            raise HostConnectError(
                f"cannot connect to {self._where}: {exc.strerror or exc}; {self._unreachable_fix}"
            ) from None

    def _handshake(self, transport: paramiko.Transport, deadline: float) -> paramiko.PKey:
        """Banner and key exchange; returns the server's host key."""
        timeout = min(self._connect_timeout_s, _remaining(deadline))
        transport.banner_timeout = timeout
        try:
            transport.start_client(timeout=timeout)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise HostConnectError(f"SSH handshake with {self._where} failed: {exc}") from None
        if not transport.is_active() or transport.host_key is None:  # start_client returns on timeout
            raise HostConnectError(f"SSH handshake with {self._where} timed out after {timeout:.0f} s")
        return transport.get_remote_server_key()

    def _known_keys(self) -> paramiko.HostKeys:
        keys = paramiko.HostKeys()
        if self._known_hosts.is_file():
            keys.load(os.fspath(self._known_hosts))
        return keys

    def _prefer_known_key_types(self, transport: paramiko.Transport) -> None:
        """Ask for the key type we already know, as OpenSSH does, so a known host verifies."""
        known = self._known_keys().lookup(self._host_key_name)
        if not known:
            return
        options = transport.get_security_options()
        preferred = [
            name
            for known_type in known
            for name in (("rsa-sha2-512", "rsa-sha2-256") if known_type == "ssh-rsa" else (known_type,))
            if name in options.key_types
        ]
        options.key_types = preferred + [t for t in options.key_types if t not in preferred]

    def _verify_host_key(self, key: paramiko.PKey) -> None:
        offered = host_key_fingerprint(key)
        known = self._known_keys().lookup(self._host_key_name)
        if known is None:
            if not self._trust_on_first_use:
                raise HostKeyError(
                    f"unknown host key for {self._host_key_name} ({key.get_name()} {offered}); check that "
                    f"fingerprint with the host's administrator, then add the key: {self._keyscan} "
                    "(or set the host's trust_on_first_use: true)",
                    host=self._host_key_name,
                    fingerprint=offered,
                )
            self._record_host_key(key)
            return
        expected = known.get(key.get_name())
        if expected != key:
            expected_text = ", ".join(host_key_fingerprint(k) for k in known.values())
            raise HostKeyError(
                f"host key for {self._host_key_name} changed: server offered {key.get_name()} "
                f"{offered}, {self._known_hosts} has {expected_text}; refusing to connect. Only if the host was "
                f"reinstalled: ssh-keygen -R '{self._host_key_name}' -f {self._known_hosts}, then {self._keyscan}",
                host=self._host_key_name,
                fingerprint=offered,
            )

    def _record_host_key(self, key: paramiko.PKey) -> None:
        self._known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self._known_hosts, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as handle:
            handle.write(f"{self._host_key_name} {key.get_name()} {key.get_base64()}\n")

    def _authenticate(self, transport: paramiko.Transport, deadline: float) -> None:
        """The key file first, then the agent's keys; a key file that cannot be loaded is reported
        only if no agent key gets in either."""
        transport.auth_timeout = min(self._auth_timeout_s, _remaining(deadline))
        agent = paramiko.Agent() if self._use_agent else None
        file_error: HostAuthError | None = None
        keys: list[paramiko.PKey] = []
        try:
            if self._key_filename is not None:
                try:
                    keys.append(self._load_key_file(self._key_filename))
                except HostAuthError as exc:
                    file_error = exc
            if agent is not None:
                keys.extend(agent.get_keys())
            for key in keys:
                if self._try_key(transport, key):
                    return
        finally:
            if agent is not None:
                agent.close()
        if file_error is not None:
            raise file_error
        if not keys:
            raise HostAuthError(
                f"no SSH key for {self._where}: no key file given and no agent key; set the host's key_file"
            )
        raise HostAuthError(
            f"authentication failed for {self._where}: {self._key_description(len(keys))} refused; check the "
            f"host's username and key_file (the key's .pub must be in ~{self.username}/.ssh/authorized_keys there)"
        )

    def _try_key(self, transport: paramiko.Transport, key: paramiko.PKey) -> bool:
        """One publickey attempt: True if accepted, False if refused; raises on a broken connection."""
        try:
            transport.auth_publickey(self.username, key)
        except paramiko.AuthenticationException as exc:
            if "timeout" in str(exc).lower():
                raise HostConnectError(
                    f"authentication with {self._where} timed out after {transport.auth_timeout:.0f} s"
                ) from None
            return False
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise HostConnectError(f"connection to {self._where} failed during authentication: {exc}") from None
        return True

    def _load_key_file(self, path: Path) -> paramiko.PKey:
        secret = self._passphrase
        if secret is None and self._passphrase_env is not None:
            secret = os.environ.get(self._passphrase_env)
        # cryptography decrypts with bytes (the paramiko stubs say str; a str fails with TypeError)
        passphrase = secret.encode() if secret else None
        try:
            return paramiko.PKey.from_path(path, passphrase)  # type: ignore[arg-type]
        except (TypeError, paramiko.PasswordRequiredException):
            if passphrase is None and self._passphrase_env is not None:
                raise HostAuthError(
                    f"private key {path} is encrypted and its passphrase variable {self._passphrase_env} is not set"
                ) from None
            if passphrase is None:
                raise HostAuthError(f"private key {path} is encrypted and no passphrase was given") from None
            raise HostAuthError(f"cannot load private key {path} (bad passphrase?)") from None
        except (paramiko.SSHException, UnknownKeyType, OSError, ValueError) as exc:
            raise HostAuthError(f"cannot load private key {path} ({type(exc).__name__})") from None

    def _key_description(self, count: int) -> str:
        if self._key_filename is not None and count == 1:
            return f"key {self._key_filename}"
        return f"{count} key(s) (file and agent)"

    # -- commands ---------------------------------------------------------------------------

    def _execute(
        self, channel: paramiko.Channel, command: str, started: float, deadline: float, stdin: bytes = b""
    ) -> CommandResult:
        transport = channel.get_transport()
        with _Watchdog(deadline, transport.close) as watchdog:
            try:
                channel.exec_command(command)
                if stdin:
                    channel.sendall(stdin)
                channel.shutdown_write()
            except (paramiko.SSHException, OSError, EOFError) as exc:
                if watchdog.fired:
                    return CommandResult(None, "", "", time.monotonic() - started, True)
                raise HostDisconnectedError(f"cannot start a command on {self._where}: {exc}") from None
        out, err, finished = _drain(channel, deadline)
        duration = time.monotonic() - started
        if not finished:
            channel.close()
            return CommandResult(None, text(out), text(err), duration, True)
        status = channel.exit_status
        if status == -1 and _connection_lost(transport):
            raise HostDisconnectedError(f"connection to {self._where} dropped after {duration:.1f} s of a command")
        return CommandResult(None if status == -1 else status, text(out), text(err), duration, False)

    # -- long-running commands and files ----------------------------------------------------------

    def stream(
        self,
        command: str,
        on_stdout: Callable[[str], None],
        on_stderr: Callable[[str], None],
        connect_timeout_s: float = 30.0,
        idle_timeout_s: float | None = None,
    ) -> int | None:
        """Run `command` with no overall time limit, calling `on_stdout`/`on_stderr` with each
        complete line (without its newline) as it arrives; returns the exit status (None if the
        command died without one). A dropped connection raises `HostDisconnectedError`, and so
        does silence longer than `idle_timeout_s` (a frozen link sends no reset: give the command
        a heartbeat and this a limit). An exception raised by a callback, or an interrupt,
        closes the channel and propagates."""
        deadline = time.monotonic() + connect_timeout_s
        channel = self._open_channel(deadline)
        transport = channel.get_transport()
        try:
            try:
                channel.exec_command(command)
            except (paramiko.SSHException, OSError, EOFError) as exc:
                raise HostDisconnectedError(f"cannot start a command on {self._where}: {exc}") from None
            out, err = _LineSplitter(on_stdout), _LineSplitter(on_stderr)
            heard = time.monotonic()
            while True:
                while channel.recv_ready():
                    out.feed(channel.recv(_CHUNK))
                    heard = time.monotonic()
                while channel.recv_stderr_ready():
                    err.feed(channel.recv_stderr(_CHUNK))
                    heard = time.monotonic()
                if channel.closed and not channel.recv_ready() and not channel.recv_stderr_ready():
                    break
                if _connection_lost(transport):
                    raise HostDisconnectedError(f"connection to {self._where} dropped while streaming a command")
                if idle_timeout_s is not None and time.monotonic() - heard > idle_timeout_s:
                    transport.close()
                    raise HostDisconnectedError(
                        f"nothing from {self._where} for {idle_timeout_s:g} s while "
                        "streaming a command (a frozen link?)"
                    )
                select.select([channel], [], [], _POLL_S)
            out.flush()
            err.flush()
            status = channel.exit_status
            if status == -1 and _connection_lost(transport):
                raise HostDisconnectedError(f"connection to {self._where} dropped while streaming a command")
            return None if status == -1 else status
        finally:
            channel.close()

    def upload(self, local: str | os.PathLike[str], remote: str, timeout_s: float = 3600.0) -> None:
        """Copy a local file to `remote` over SFTP, atomically (a temporary name, then a rename);
        the remote folder must exist."""
        with self._sftp(timeout_s) as sftp:
            partial = f"{remote}.partial"
            try:
                sftp.put(os.fspath(local), partial)
                sftp.posix_rename(partial, remote)
            except (OSError, paramiko.SSHException, EOFError) as exc:
                raise HostDisconnectedError(
                    f"cannot upload {os.fspath(local)} to {self._where}:{remote}: {exc}"
                ) from None

    def download(self, remote: str, local: str | os.PathLike[str], timeout_s: float = 3600.0) -> None:
        """Copy `remote` to a local file over SFTP, atomically (a temporary name, then a rename)."""
        target = Path(local)
        partial = target.with_name(f".{target.name}.partial")
        with self._sftp(timeout_s) as sftp:
            try:
                sftp.get(remote, os.fspath(partial))
            except (OSError, paramiko.SSHException, EOFError) as exc:
                partial.unlink(missing_ok=True)
                raise HostDisconnectedError(f"cannot download {self._where}:{remote}: {exc}") from None
        os.replace(partial, target)

    @contextlib.contextmanager
    def _sftp(self, timeout_s: float) -> Iterator[paramiko.SFTPClient]:
        deadline = time.monotonic() + timeout_s
        transport, _ = self._live_transport(deadline)
        try:
            sftp = paramiko.SFTPClient.from_transport(transport)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise HostConnectError(f"cannot open SFTP on {self._where}: {exc}") from None
        if sftp is None:
            raise HostConnectError(f"cannot open SFTP on {self._where}")
        channel = sftp.get_channel()
        if channel is not None:
            channel.settimeout(timeout_s)
        try:
            yield sftp
        finally:
            sftp.close()


class _LineSplitter:
    """Bytes in, complete decoded lines out (a partial last line waits for its newline)."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit = emit
        self._pending = b""

    def feed(self, data: bytes) -> None:
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            self._emit(text(line))

    def flush(self) -> None:
        if self._pending:
            self._emit(text(self._pending))
            self._pending = b""


def _drain(channel: paramiko.Channel, deadline: float) -> tuple[bytes, bytes, bool]:
    """Read stdout and stderr together until the channel closes or the deadline passes."""
    out: list[bytes] = []
    err: list[bytes] = []
    while True:
        while channel.recv_ready():
            out.append(channel.recv(_CHUNK))
        while channel.recv_stderr_ready():
            err.append(channel.recv_stderr(_CHUNK))
        if channel.closed and not channel.recv_ready() and not channel.recv_stderr_ready():
            return b"".join(out), b"".join(err), True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return b"".join(out), b"".join(err), False
        select.select([channel], [], [], min(remaining, _POLL_S))


def _connection_lost(transport: paramiko.Transport) -> bool:
    """The connection died (the transport thread unlinks channels before it clears `active`)."""
    return not transport.is_active() or transport.saved_exception is not None


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


class _Watchdog:
    """Calls `action` if the block is still running at `deadline` (for calls with no timeout)."""

    def __init__(self, deadline: float, action: Callable[[], None]) -> None:
        self.fired = False
        self._action = action
        self._timer = threading.Timer(_remaining(deadline), self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        self._action()

    def __enter__(self) -> _Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()
