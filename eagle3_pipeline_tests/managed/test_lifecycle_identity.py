"""A managed server's identity across reboots and dropped connections, with the SGLang stand-in as the engine
(conftest; no SGLang engine here) on this machine and over a loopback sshd of the test's own (restarted
mid-start, behind a TCP proxy that cuts the live connection): a pid file from another boot whose pid is
someone else's now means the server exited, and the run starts a new one with no manual step; a launch
recorded but not yet ready is waited for, not refused or started twice; an SSH drop while the server
loads is reconnected and the start goes on; a host that stays away fails with one message; the launch
runs in the login shell or after an env file when the settings say so."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.hosts import Host, HostConnectError, LocalHost
from eagle3_pipeline.managed import (
    HostUnreachableError,
    LaunchLine,
    ManagedServer,
    ManagedServerError,
    ServerEvent,
    ServerPurpose,
    ServerRecord,
    StartResult,
    Supervisor,
    launch_for,
    managed_server,
)
from eagle3_pipeline.managed.lifecycle import parse_stat
from eagle3_pipeline.testing.process_groups import processes_of
from eagle3_pipeline.testing.process_tools import wait_until, write_atomic
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd, TcpProxy
from eagle3_pipeline_tests.managed.pipelines import fake_sglang_serving
from eagle3_pipeline_tests.pipeline_files import load_pipeline

GENERATION = ServerPurpose.generation(needs_tools=False)
pytestmark = pytest.mark.usefixtures("stop_servers")


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """These tests start `python -m sglang.launch_server` stand-ins, which the health tests look for."""


def managed(tmp_path: Path, host: Host, **serving: Any) -> tuple[ManagedServer, LaunchLine]:
    config = load_pipeline(tmp_path, {"serving": fake_sglang_serving(tmp_path, **serving)})
    setup = managed_server(config)
    assert setup is not None
    server = ManagedServer(host, setup)
    server.poll_s = 0.2
    return server, launch_for(config.target, setup, GENERATION)


def scenario(tmp_path: Path, **values: Any) -> None:
    """The stand-in's scenario (fake_sglang.FakeSglang.set), e.g. generate=error: it loads, never ready."""
    write_atomic(tmp_path / "engine" / "scenario.json", json.dumps(values))


@pytest.fixture
def someone_else() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "300"], start_new_session=True)
    yield process
    process.kill()
    process.wait()


def test_a_pid_file_from_before_a_reboot_means_exited_and_the_run_starts_a_new_server(
    tmp_path: Path, someone_else: subprocess.Popen[bytes]
) -> None:
    """The recorded pid is alive and someone else's (its start time and group match, as a pid and start time
    reused after a reboot can); only the boot id differs."""
    server, launch = managed(tmp_path, LocalHost())
    info = parse_stat(Path(f"/proc/{someone_else.pid}/stat").read_text())
    stale = ServerRecord(
        pid=someone_else.pid,
        pgid=info.pgid,
        start_ticks=info.start_ticks,
        boot_id="00000000-0000-0000-0000-000000000000",
        argv=launch.argv,
        env_names=(),
        engine="sglang",
        port=server.setup.port,
        role="generation",
        reason="a run before the reboot",
        started_at="2026-12-01T00:00:00+00:00",
        log_path=server.log_path,
    )
    Path(server.pid_path).parent.mkdir(parents=True, exist_ok=True)
    Path(server.pid_path).write_text(stale.to_json())
    status = server.status()
    assert status.state == "exited" and "the host rebooted since its start (boot id " in status.detail

    events: list[ServerEvent] = []
    supervisor = Supervisor(server, lambda purpose: launch, events.append)
    supervisor.ensure(GENERATION, "responses B1")  # no manual step
    assert [(e.action, e.role) for e in events] == [("started", "generation")]
    assert "the host rebooted since its start" in events[0].metadata["replaced"]
    assert someone_else.poll() is None, "the process that now has the pid was not signalled"
    record = server.read_record()
    assert record is not None and record.pid != someone_else.pid and server.status().state == "running"
    assert server.stop("done").verified

    Path(server.pid_path).write_text(stale.to_json())  # a stop after a reboot: nothing to signal, the file goes
    stopped = server.stop("hand-over")
    assert stopped.verified and stopped.signals == () and server.status().state == "absent"
    assert someone_else.poll() is None


def _start_in_thread(server: ManagedServer, launch: LaunchLine) -> tuple[threading.Thread, list[Any]]:
    """``server.start`` in a thread; its result (or error) in the list once done."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(server.start(launch, "generation"))
        except Exception as exc:  # handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_launch_recorded_but_not_ready_is_waited_for(tmp_path: Path) -> None:
    """A launch whose start went away before the server was ready (its connection dropped, or another run
    still waits for it): recorded at the launch, before it can bind. The supervisor keeps it once ready, a
    start of the same launch line waits for it instead of refusing or launching a second one."""
    server, launch = managed(tmp_path, LocalHost())
    scenario(tmp_path, unready_probes=3)  # the first three readiness probes: still loading
    record = server._launch(launch, "a start that went away", None)
    assert record.cmdline is None and server.status().state == "running"
    events: list[ServerEvent] = []
    supervisor = Supervisor(server, lambda purpose: launch, events.append)
    supervisor.ensure(GENERATION, "responses B1")
    assert [(e.action, e.role) for e in events] == [("kept", "generation")]
    assert "until it was ready" in events[0].reason
    confirmed = server.read_record()
    assert confirmed is not None and confirmed.cmdline == launch.argv and len(confirmed.members) == 3
    assert server.stop("next case").verified

    record = server._launch(launch, "a start that went away", None)
    adopted = server.start(launch, "generation, a second run")
    assert adopted.adopted and adopted.pid == record.pid and adopted.as_metadata()["adopted"] is True
    assert len(processes_of(record.pid)) == 3, "one server, not two"
    assert server.stop("done").verified


@pytest.fixture
def own_sshd(tmp_path_factory: pytest.TempPathFactory, fakebin: FakeBin) -> Iterator[Sshd]:
    """A loopback sshd of this test's own (the session's is shared), restarted by the test."""
    server = Sshd(tmp_path_factory.mktemp("own_sshd"), fakebin.dir).start()
    yield server
    server.stop()


def test_an_ssh_drop_while_the_server_loads_is_reconnected_and_the_start_goes_on(
    tmp_path: Path, own_sshd: Sshd
) -> None:
    proxy = TcpProxy(own_sshd.port)
    host = own_sshd.host(port=proxy.port, known_hosts=own_sshd.known_hosts_via(proxy.port))
    try:
        server, launch = managed(tmp_path, host, bind_host="127.0.0.1")
        scenario(tmp_path, generate="error")  # loading: the readiness loop goes on
        thread, outcome = _start_in_thread(server, launch)
        wait_until(lambda: Path(server.pid_path).exists(), 30, "the launch record")
        own_sshd.stop()  # the host's sshd goes down and the live connection drops
        proxy.cut()
        wait_until(lambda: server.reconnects > 0, 60, "a failed reconnect while sshd is down")
        own_sshd.restart()
        scenario(tmp_path)  # the server gets ready
        thread.join(120)
        started = outcome[0]
        assert isinstance(started, StartResult), started
        assert started.reconnects >= 1 and started.report.healthy and started.as_metadata()["reconnects"] >= 1
        print(f"reconnects during the start: {started.reconnects}; start took {started.duration_s:.1f} s")
        assert server.status().state == "running" and len(processes_of(started.pid)) == 3
        assert server.stop("done").verified
    finally:
        host.close()
        proxy.close()


def test_a_host_that_stays_away_fails_with_one_message(tmp_path: Path, own_sshd: Sshd) -> None:
    host = own_sshd.host()
    try:
        server, _ = managed(tmp_path, host, reconnect_timeout_s=1)
        assert server.status().state == "absent"
        own_sshd.stop()
        host.close()
        with pytest.raises(HostUnreachableError) as caught:
            server.status()
        assert "could not be reopened within 1 s (serving.reconnect_timeout_s)" in str(caught.value)
        assert isinstance(caught.value, ManagedServerError) and isinstance(caught.value.cause, HostConnectError)
        assert server.reconnects >= 1
    finally:
        host.close()


def test_the_launch_runs_in_the_login_shell_and_after_the_env_file(tmp_path: Path, own_sshd: Sshd) -> None:
    """The sshd's sessions have HOME = its home folder, whose .profile a login shell reads."""
    (own_sshd.dir / "home" / ".profile").write_text("export CUDA_HOME=/opt/cuda-from-profile\n")
    env_file = tmp_path / "serving.env"
    env_file.write_text("EAGLE3_FROM_ENV_FILE=yes\nPATH=/opt/cuda-from-file/bin:$PATH\n")
    host = own_sshd.host()
    try:
        server, launch = managed(tmp_path, host, bind_host="127.0.0.1", login_shell=True, env_file=str(env_file))
        started = server.start(launch, "generation")
        environ = dict(
            item.split("=", 1) for item in Path(f"/proc/{started.pid}/environ").read_text().split("\0") if "=" in item
        )
        assert environ["CUDA_HOME"] == "/opt/cuda-from-profile" and environ["EAGLE3_FROM_ENV_FILE"] == "yes"
        assert environ["PATH"].startswith("/opt/cuda-from-file/bin:")
        record = server.read_record()
        assert record is not None and record.cmdline == launch.argv, "the wrappers exec'd: the pid is the server's"
        assert server.stop("done").verified
    finally:
        host.close()
        (own_sshd.dir / "home" / ".profile").unlink()
