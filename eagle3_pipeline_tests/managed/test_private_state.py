"""A managed server's state (pid file, log, env file) is private, and `serving.env` never reaches a command
line: a planted symbolic link (the log, the pid file) is refused and its target left alone; a folder others can
write is refused before anything starts; over the loopback sshd, the env's values are in the server's
environment and in no process's ``/proc/<pid>/cmdline``, pid file or log. The engine is the SGLang stand-in
(conftest) and nvidia-smi the scripted one: no GPU here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.hosts import CommandResult, Host, LocalHost
from eagle3_pipeline.managed import (
    LaunchLine,
    ManagedServer,
    ManagedServerError,
    ServerPurpose,
    launch_for,
    managed_server,
)
from eagle3_pipeline.testing.process_groups import processes_of
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd
from eagle3_pipeline_tests.managed.pipelines import fake_sglang_serving, ssh_health
from eagle3_pipeline_tests.pipeline_files import load_pipeline

SECRET = "s3cret-value-7f1c"
GENERATION = ServerPurpose.generation(needs_tools=False)


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """These tests start `python -m sglang.launch_server` stand-ins, which the health tests look for."""


def managed(tmp_path: Path, host: Host, sections: dict[str, Any]) -> tuple[ManagedServer, LaunchLine]:
    config = load_pipeline(tmp_path, sections)
    setup = managed_server(config)
    assert setup is not None
    return ManagedServer(host, setup), launch_for(config.target, setup, GENERATION)


def test_a_planted_log_link_is_refused_and_nothing_starts(tmp_path: Path, stop_servers: None) -> None:
    server, launch = managed(tmp_path, LocalHost(), {"serving": fake_sglang_serving(tmp_path)})
    (tmp_path / "logs").mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    Path(server.log_path).symlink_to(victim)
    with pytest.raises(ManagedServerError, match=rf"the log {server.log_path} is a symbolic link: refused"):
        server.start(launch, "generation")
    assert victim.read_text() == "precious\n" and server.status().state == "absent"


def test_a_planted_pid_file_link_is_refused_and_nothing_is_signalled(tmp_path: Path) -> None:
    server, _ = managed(tmp_path, LocalHost(), {"serving": fake_sglang_serving(tmp_path)})
    (tmp_path / "logs").mkdir(mode=0o700)
    planted = tmp_path / "planted.json"
    planted.write_text('{"version": 1}')
    Path(server.pid_path).symlink_to(planted)
    with pytest.raises(ManagedServerError, match=r"holds managed-\d+\.json as a symbolic link.*nothing was signalled"):
        server.stop("a planted record must not steer the stop")


def test_a_state_folder_others_can_write_is_refused_before_the_start(tmp_path: Path, stop_servers: None) -> None:
    server, launch = managed(tmp_path, LocalHost(), {"serving": fake_sglang_serving(tmp_path)})
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs").chmod(0o1777)
    with pytest.raises(
        ManagedServerError, match=r"serving\.log_dir: the state folder .*/logs on localhost is writable"
    ):
        server.start(launch, "generation")
    assert list((tmp_path / "logs").iterdir()) == []


def test_env_values_reach_the_server_over_ssh_but_no_command_line(
    tmp_path: Path, sshd: Sshd, fakebin: FakeBin, stop_servers: None
) -> None:
    fakebin.reset()
    serving = fake_sglang_serving(tmp_path, bind_host="127.0.0.1")
    serving["env"] = {**serving["env"], "EAGLE3_TEST_SECRET": SECRET}
    ssh = sshd.host()
    host = CommandsSent(ssh)
    try:
        server, launch = managed(tmp_path, host, {"serving": serving, "health": ssh_health(sshd)})
        started = server.start(launch, "generation")
        members = processes_of(started.pid)
        assert members
        environ = Path(f"/proc/{started.pid}/environ").read_bytes()
        assert f"EAGLE3_TEST_SECRET={SECRET}".encode() in environ.split(b"\0")
        holders = [path.parent.name for path in Path("/proc").glob("[0-9]*/cmdline") if SECRET.encode() in _read(path)]
        assert holders == []
        assert host.commands and not [c for c in host.commands if SECRET in c]  # each is a `sh -c` argv there
        env_file = Path(server.setup.serving.env_path)
        assert oct(env_file.stat().st_mode & 0o777) == "0o600" and SECRET in env_file.read_text()
        for shown in (Path(server.pid_path).read_text(), Path(server.log_path).read_text(), started.command):
            assert SECRET not in shown
        assert server.stop("done").verified
    finally:
        ssh.close()


class CommandsSent(Host):
    """The SSH host, keeping each command line it is sent: the host's shell runs it as its argv."""

    def __init__(self, inner: Host) -> None:
        self.inner = inner
        self.name = inner.name
        self.commands: list[str] = []

    def run(self, command: str, timeout_s: float, stdin: bytes = b"") -> CommandResult:
        self.commands.append(command)
        return self.inner.run(command, timeout_s, stdin)

    def close(self) -> None:
        self.inner.close()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # a process that exited while the table was read
        return b""
