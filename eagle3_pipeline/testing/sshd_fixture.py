"""Real stand-ins for a GPU inference host, shared by the health tests and the benchmark.

- `Sshd`: a real OpenSSH `sshd` (Debian `openssh-server`) on 127.0.0.1 with throwaway host and
  user keys. Sessions get an empty HOME (the developer's shell rc files stay out of the
  timings) and run through a `ForceCommand` wrapper that puts `FakeBin` first on PATH, so the
  probes meet the scripted `nvidia-smi`/`dmesg`. Needs root (sshd's privilege separation) and
  `/usr/sbin/sshd`.
- `FakeBin`: shell scripts standing in for `nvidia-smi`, `dmesg` and `journalctl`. This machine
  has no GPU; they stand in for the hardware and its kernel log, with scripted answers (healthy,
  ECC errors, pending or failed row remaps, a renamed field, a driver without the remap query, a
  restricted dmesg, a hang, a process wedged beyond `timeout`, the compute processes holding GPU memory).
- The scripted SGLang server they watch is :class:`~eagle3_pipeline.testing.fake_sglang.FakeSglang`.
- `TcpProxy`: a loopback TCP forwarder that can freeze (a hung host) or cut (a dropped link).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import HealthConfig
from eagle3_pipeline.health import HealthThresholds
from eagle3_pipeline.health.checks.gpus import GPU_QUERY_FIELDS, REMAP_QUERY_FIELDS
from eagle3_pipeline.hosts import SshHost
from eagle3_pipeline.testing.process_tools import free_port, kill_group, wait_until, write_atomic

SSHD = "/usr/sbin/sshd"
# The --query-compute-apps fields of nvidia-smi (`nvidia-smi --help-query-compute-apps`; used_memory is an alias).
COMPUTE_APP_FIELDS = (
    "timestamp",
    "gpu_name",
    "gpu_bus_id",
    "gpu_uuid",
    "pid",
    "process_name",
    "used_gpu_memory",
    "used_memory",
)


def bus_id(index: int) -> str:
    """The PCI bus id nvidia-smi prints for fake GPU `index`."""
    return f"00000000:{0x18 + 0x10 * index:02X}:00.0"


def gpu_row(
    index: int,
    *,
    util: str = "97",
    temp: str | None = None,
    ecc: str = "0",
    retired: str = "[N/A]",
    used: int = 130000,
) -> str:
    """One `--query-gpu` row of an H200 (row remapping, so retired pages are [N/A]); `used`: memory.used MiB."""
    temp = temp if temp is not None else str(40 + index)
    return f"{index}, {bus_id(index)}, NVIDIA H200, {used}, 143771, {util}, {temp}, {ecc}, {retired}"


def healthy_gpu_rows(count: int = 8) -> list[str]:
    """GPUs a running server holds (130000 MiB used each)."""
    return [gpu_row(i) for i in range(count)]


def idle_gpu_rows(count: int = 8) -> list[str]:
    """GPUs nobody holds (5 MiB used, 0 % busy): what a managed server's start needs."""
    return [gpu_row(i, util="0", used=5) for i in range(count)]


def remap_row(index: int, *, uncorrectable: int = 0, pending: str = "0", failure: str = "0") -> str:
    """One `--query-remapped-rows` row."""
    return f"{bus_id(index)}, 0, {uncorrectable}, {pending}, {failure}"


def healthy_remap_rows(count: int = 8) -> list[str]:
    return [remap_row(i) for i in range(count)]


# -- fake nvidia-smi and dmesg -------------------------------------------------------------------

_NVIDIA_SMI = """#!/bin/sh
# Stand-in for nvidia-smi: this machine has no GPU. Answers from files in {dir}.
d={dir}
query=
kind=gpu
for a in "$@"; do
  case $a in
    --query-gpu=*) query=${{a#--query-gpu=}} ;;
    --query-remapped-rows=*) query=${{a#--query-remapped-rows=}}; kind=remap ;;
    --query-compute-apps=*) query=${{a#--query-compute-apps=}}; kind=apps ;;
  esac
done
case $(cat "$d/mode") in
  hang) exec sleep 3600 ;;
  wedged) echo $$ $PPID >>"$d/wedged.pids"; kill -STOP $PPID; exec sleep 3600 ;;
esac
if [ ! -f "$d/$kind.fields" ]; then
  echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."; exit 2
fi
old_ifs=$IFS; IFS=,
for f in $query; do
  grep -qxF "$f" "$d/$kind.fields" || {{ printf 'Field "%s" is not a valid field to query.\\n\\n' "$f"; exit 2; }}
done
IFS=$old_ifs
exec cat "$d/$kind.csv"
"""
_DMESG = """#!/bin/sh
# Stand-in for dmesg: the kernel log of a GPU host, from {dir}/dmesg.txt, unless restricted.
if [ -f {dir}/dmesg.restricted ]; then
  echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1
fi
exec cat {dir}/dmesg.txt
"""
_JOURNALCTL = """#!/bin/sh
# Stand-in for journalctl: the kernel messages this user may read (none unless scripted).
exec cat {dir}/journal.txt
"""
_BENIGN_DMESG = [
    "[    0.000000] Linux version 6.1.0-18-amd64",
    "[   12.345678] nvidia-nvlink: Nvlink Core is being initialized, major device number 510",
    "[   13.000001] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
]


class FakeBin:
    """A directory of scripted `nvidia-smi`, `dmesg` and `journalctl` commands."""

    def __init__(self, root: Path) -> None:
        self.dir = root
        self.dir.mkdir(parents=True, exist_ok=True)
        for name, template in (("nvidia-smi", _NVIDIA_SMI), ("dmesg", _DMESG), ("journalctl", _JOURNALCTL)):
            path = self.dir / name
            path.write_text(template.format(dir=self.dir))
            path.chmod(0o755)
        self.reset()

    def reset(self) -> None:
        self.release_wedged()
        self.set_gpus(healthy_gpu_rows())
        self.set_remaps(healthy_remap_rows())
        self.set_compute_apps([])
        self.set_mode("ok")
        self.set_fields(GPU_QUERY_FIELDS)
        self.set_dmesg(_BENIGN_DMESG)
        self.set_journal([])

    def set_gpus(self, rows: list[str]) -> None:
        write_atomic(self.dir / "gpu.csv", "".join(row + "\n" for row in rows))

    def set_remaps(self, rows: list[str] | None) -> None:
        """`--query-remapped-rows` rows; None: a driver that does not know the query."""
        if rows is None:
            (self.dir / "remap.fields").unlink(missing_ok=True)
            return
        write_atomic(self.dir / "remap.fields", "".join(f + "\n" for f in REMAP_QUERY_FIELDS))
        write_atomic(self.dir / "remap.csv", "".join(row + "\n" for row in rows))

    def set_compute_apps(self, rows: list[str]) -> None:
        """`--query-compute-apps` rows, e.g. "1234, 8192" for pid,used_memory (csv,noheader,nounits)."""
        write_atomic(self.dir / "apps.fields", "".join(f + "\n" for f in COMPUTE_APP_FIELDS))
        write_atomic(self.dir / "apps.csv", "".join(row + "\n" for row in rows))

    def set_mode(self, mode: str) -> None:
        """ok | hang (sleeps until killed) | wedged (also stops its `timeout` parent)."""
        write_atomic(self.dir / "mode", mode + "\n")

    def set_fields(self, fields: tuple[str, ...] | list[str]) -> None:
        """The query fields this fake driver knows; others fail as a real nvidia-smi does."""
        write_atomic(self.dir / "gpu.fields", "".join(f + "\n" for f in fields))

    def set_dmesg(self, lines: list[str], *, restricted: bool = False) -> None:
        """The kernel ring buffer; `restricted` makes dmesg fail as with kernel.dmesg_restrict=1."""
        write_atomic(self.dir / "dmesg.txt", "".join(line + "\n" for line in lines))
        restriction = self.dir / "dmesg.restricted"
        if restricted:
            restriction.touch()
        else:
            restriction.unlink(missing_ok=True)

    def set_journal(self, lines: list[str]) -> None:
        """What `journalctl -k` shows this user (nothing: no access to the system journal)."""
        write_atomic(self.dir / "journal.txt", "".join(line + "\n" for line in lines))

    def release_wedged(self) -> None:
        pids = self.dir / "wedged.pids"
        if not pids.exists():
            return
        for pid in pids.read_text().split():
            _kill(int(pid), signal.SIGKILL)
        pids.unlink()


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


# -- sshd ------------------------------------------------------------------------------------------

_SSHD_CONFIG = """Port {port}
ListenAddress 127.0.0.1
HostKey {dir}/ssh_host_ed25519_key
PidFile none
AuthorizedKeysFile {dir}/authorized_keys
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
SetEnv HOME={dir}/home
ForceCommand {dir}/session
Subsystem sftp /usr/lib/openssh/sftp-server
MaxStartups 100
MaxSessions 100
LogLevel VERBOSE
"""
_SESSION = """#!/bin/sh
# Every session: the fake GPU tools first on PATH, then the client's command.
PATH={fakebin}:$PATH; export PATH
exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"
"""


class Sshd:
    """A real OpenSSH server on 127.0.0.1 with throwaway keys; `host()` connects to it."""

    def __init__(self, workdir: Path, fakebin: Path) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fakebin = fakebin
        self.port = free_port()
        self.client_key = self.dir / "id_ed25519"
        self.known_hosts = self.dir / "known_hosts"
        self.log_path = self.dir / "sshd.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Sshd:
        if shutil.which(SSHD) is None:
            raise RuntimeError(f"{SSHD} not found: install the openssh-server package")
        _keygen(self.dir / "ssh_host_ed25519_key")
        _keygen(self.client_key)
        shutil.copy(self.client_key.with_suffix(".pub"), self.dir / "authorized_keys")
        host_pub = (self.dir / "ssh_host_ed25519_key.pub").read_text().split()
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_pub[0]} {host_pub[1]}\n")
        (self.dir / "home").mkdir(exist_ok=True)
        session = self.dir / "session"
        session.write_text(_SESSION.format(fakebin=self.fakebin))
        session.chmod(0o755)
        config = self.dir / "sshd_config"
        config.write_text(_SSHD_CONFIG.format(port=self.port, dir=self.dir))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        return self.restart()

    def restart(self) -> Sshd:
        """(Re)start the daemon on the same port with the same keys, as a restart of the host's sshd does."""
        self.stop()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(self.dir / "sshd_config")], stderr=log, start_new_session=True
            )
        wait_until(self._answers, 10, "sshd")
        return self

    def known_hosts_via(self, port: int) -> Path:
        """A known_hosts file naming this server's key at 127.0.0.1:`port` (a `TcpProxy` in front of it)."""
        path = self.dir / f"known_hosts_{port}"
        key = self.known_hosts.read_text().split(maxsplit=1)[1]
        path.write_text(f"[127.0.0.1]:{port} {key}")
        return path

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                return sock.recv(8).startswith(b"SSH-")
        except OSError:
            return False

    def host(self, **overrides: Any) -> SshHost:
        options: dict[str, Any] = {
            "port": self.port,
            "username": getpass.getuser(),
            "key_file": self.client_key,
            "key_passphrase_env": None,
            "allow_agent": False,
            "known_hosts": self.known_hosts,
            "trust_on_first_use": False,
            "connect_timeout_s": 5.0,
            "auth_timeout_s": 5.0,
        }
        options.update(overrides)
        return SshHost("127.0.0.1", **options)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process is not None:
            kill_group(self.process)
            self.process = None


def _keygen(path: Path) -> None:
    for stale in (path, path.with_suffix(".pub")):
        stale.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


# -- TCP proxy -------------------------------------------------------------------------------------


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target port; `freeze()` stops all traffic, `cut()` drops it."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._frozen = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self._frozen.set()

    def thaw(self) -> None:
        self._frozen.clear()

    def cut(self) -> None:
        """Reset every forwarded connection, as a dead link or a rebooted host does."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self.cut()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # nothing listens behind the proxy (a restarting sshd): the client sees a reset
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                if self._frozen.is_set():
                    time.sleep(0.05)
                    continue
                readable, _, _ = select.select([src], [], [], 0.05)
                if not readable:
                    continue
                data = src.recv(65536)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
        except (OSError, ValueError):
            return


# -- what a tick watches -----------------------------------------------------------------------


@dataclass(frozen=True)
class Watched:
    artifacts_dir: Path
    log_path: Path


def make_watched(root: Path) -> Watched:
    """An artifacts dir with a fresh output file and a fresh server log."""
    artifacts = root / "artifacts"
    (artifacts / "responses").mkdir(parents=True, exist_ok=True)
    (artifacts / "responses" / "B1.jsonl").write_text('{"id": 1}\n')
    log = root / "server.log"
    log.write_text("Decode batch. #running-req: 4, gen throughput (token/s): 1234.5\n")
    return Watched(artifacts, log)


def thresholds_for(watched: Watched | None = None, **overrides: Any) -> HealthThresholds:
    """Short probe timeouts and floors any machine meets, the rest as the pipeline file's `health:`
    section has them by default; a test overrides what it exercises."""
    file = HealthConfig()
    options: dict[str, Any] = {
        "artifacts_dir": None,
        "log_path": None,
        "hosted_probe_interval_s": file.hosted_probe_interval_s,
        "kernel_log_path": file.kernel_log_path,
        "optional_checks": frozenset(file.optional_checks),
        "expected_gpus": 8,
        "min_disk_free_gb": 0.01,
        "min_mem_free_gb": 0.01,
        "stall_window_s": 60.0,
        "throughput_min_interval_s": 0.0,
        "shell_section_timeout_s": 2.0,
        "generation_timeout_s": 2.0,
        "metrics_timeout_s": 2.0,
        "tick_timeout_s": 10.0,
    }
    if watched is not None:
        options["artifacts_dir"] = str(watched.artifacts_dir)
        options["log_path"] = str(watched.log_path)
    options.update(overrides)
    return HealthThresholds(**options)
