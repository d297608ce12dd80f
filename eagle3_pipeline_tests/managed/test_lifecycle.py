"""A managed server's life on this machine and over SSH (the loopback sshd), with the SGLang stand-in as
the engine (conftest) and the scripted nvidia-smi standing in for the GPUs: start → ready on the health tick
→ stop, verified; a stop that cannot free the GPUs; a pid file that names another process; a server that
dies during start-up; crashes (kill -9) of the group or of its leader alone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from eagle3_pipeline.hosts import Host, LocalHost
from eagle3_pipeline.managed import (
    AlreadyRunningError,
    LaunchLine,
    ManagedServer,
    ManagedServerError,
    NotOurProcessError,
    PortInUseError,
    ServerPurpose,
    ServerRecord,
    StartupFailedError,
    StopNotVerifiedError,
    launch_for,
    managed_server,
)
from eagle3_pipeline.managed.lifecycle import parse_stat
from eagle3_pipeline.testing.process_groups import processes_of
from eagle3_pipeline.testing.process_tools import free_port, wait_until
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd, idle_gpu_rows
from eagle3_pipeline_tests.managed.pipelines import (
    dying_sglang_serving,
    fake_sglang_serving,
    ssh_health,
)
from eagle3_pipeline_tests.pipeline_files import load_pipeline


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """These tests start `python -m sglang.launch_server` stand-ins, which the health tests look for."""


GENERATION = ServerPurpose.generation(needs_tools=False)


def managed(
    tmp_path: Path, host: Host, serving: dict[str, Any], health: dict[str, Any] | None = None
) -> tuple[ManagedServer, LaunchLine]:
    """The pipeline's managed server on ``host``, and its launch line for generation."""
    sections: dict[str, Any] = {"serving": serving}
    if health is not None:
        sections["health"] = health
    config = load_pipeline(tmp_path, sections)
    setup = managed_server(config)
    assert setup is not None
    return ManagedServer(host, setup), launch_for(config.target, setup, GENERATION)


@pytest.fixture
def local_path_with_gpus(fakebin: FakeBin) -> Iterator[LocalHost]:
    """This machine with the scripted nvidia-smi first on PATH (no GPU here): 8 GPUs nobody holds."""
    fakebin.reset()
    fakebin.set_gpus(idle_gpu_rows())
    yield LocalHost(env={"PATH": f"{fakebin.dir}:{os.environ['PATH']}"})
    fakebin.reset()


def test_start_ready_stop_verified_on_this_machine(tmp_path: Path) -> None:
    server, launch = managed(tmp_path, LocalHost(), fake_sglang_serving(tmp_path))
    assert server.status().state == "absent"

    started = server.start(launch, "generation needs the server")
    assert (started.role, started.reason, started.port) == (
        "generation",
        "generation needs the server",
        server.setup.port,
    )
    assert started.report.healthy and len(started.members) == 3  # the server and its two TP scheduler ranks
    assert "PYTHONPATH=…" in started.command and str(tmp_path) not in started.command.split(" -m ")[0]
    reply = httpx.post(f"{server.setup.base_url}/chat/completions", json={"model": "target", "messages": []})
    assert reply.status_code == 200
    status = server.status()
    assert status.state == "running" and status.record is not None
    assert status.record.cmdline == launch.argv and status.record.env_names == tuple(sorted(launch.env))
    assert sorted(processes_of(started.pid)) == sorted(m.pid for m in started.members)
    with pytest.raises(AlreadyRunningError, match=r"already running \(sglang pid"):
        server.start(launch, "again")

    stopped = server.stop("hand the GPUs to training")
    assert stopped.verified and stopped.was_running and stopped.signals == ("TERM",)
    assert stopped.verification.gpu_check == "skipped: no nvidia-smi on the host and health.expected_gpus is 0"
    assert processes_of(started.pid) == []
    assert server.status().state == "absent"
    log = Path(server.log_path).read_text()
    assert "eagle3-pipeline starts the generation server (generation needs the server)" in log


def test_the_same_lifecycle_over_ssh(tmp_path: Path, sshd: Sshd, fakebin: FakeBin) -> None:
    fakebin.reset()
    fakebin.set_gpus(idle_gpu_rows())
    serving = fake_sglang_serving(tmp_path, bind_host="127.0.0.1")
    config = load_pipeline(tmp_path, {"serving": serving, "health": ssh_health(sshd, expected_gpus=8)})
    setup = managed_server(config)
    assert setup is not None and setup.base_url == f"http://127.0.0.1:{serving['port']}/v1"
    host = sshd.host()
    try:
        server = ManagedServer(host, setup)
        started = server.start(launch_for(config.target, setup, GENERATION), "generation")
        assert started.host == f"127.0.0.1:{sshd.port}" and started.report.healthy
        assert {c.name: c.status.value for c in started.report.checks}["gpus"] == "ok"
        assert started.gpu_check == "ok: 8 GPU(s) free, MiB used: 5, 5, 5, 5, 5, 5, 5, 5 (the baseline)"
        stopped = server.stop("done")
        assert stopped.verified and stopped.verification.gpu_check.startswith("ok: nvidia-smi lists 0 compute")
        assert stopped.verification.gpu_memory_check.startswith("ok: 8 GPU(s) back to the baseline")
        assert processes_of(started.pid) == []
    finally:
        host.close()


def test_a_stop_that_cannot_free_the_gpus_names_what_is_held(
    tmp_path: Path, local_path_with_gpus: LocalHost, fakebin: FakeBin
) -> None:
    """The scripted nvidia-smi keeps listing the server's pid after the server is gone."""
    server, launch = managed(tmp_path, local_path_with_gpus, fake_sglang_serving(tmp_path), {"expected_gpus": 8})
    started = server.start(launch, "generation")
    fakebin.set_compute_apps([f"{started.pid}, 70000", "4000000, 512"])  # the server, and a process not ours
    with pytest.raises(StopNotVerifiedError) as caught:
        server.stop("hand the GPUs to training")
    message = str(caught.value)
    print(message)
    assert (
        f"the stop of the sglang server (pid {started.pid}, port {server.setup.port}) is not verified after" in message
    )
    assert f"GPU memory still held by pid {started.pid} (70000 MiB) (nvidia-smi --query-compute-apps)" in message
    assert "4000000" not in message
    result = caught.value.result
    assert result.verification.gpu_holders == ((started.pid, 70000),)
    assert not result.verification.processes_left and not result.verification.port_holders
    assert processes_of(started.pid) == [] and server.status().state == "absent"


def test_no_nvidia_smi_where_gpus_are_expected_is_not_verified(tmp_path: Path) -> None:
    server, launch = managed(tmp_path, LocalHost(), fake_sglang_serving(tmp_path), {"expected_gpus": 2})
    server.start(launch, "generation")
    with pytest.raises(
        StopNotVerifiedError,
        match=r"cannot verify the GPUs: no nvidia-smi on the host, which should "
        r"have 2 \(health.expected_gpus\)",
    ):
        server.stop("done")


@pytest.fixture
def foreign_process() -> Iterator[subprocess.Popen[bytes]]:
    """A process the pipeline did not start."""
    process = subprocess.Popen(["sleep", "300"], start_new_session=True)
    yield process
    process.kill()
    process.wait()


def foreign_record(process: subprocess.Popen[bytes], server: ManagedServer, **changes: Any) -> ServerRecord:
    info = parse_stat(Path(f"/proc/{process.pid}/stat").read_text())
    fields: dict[str, Any] = {
        "pid": process.pid,
        "pgid": info.pgid,
        "start_ticks": info.start_ticks,
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "argv": ("/venv/bin/python", "-m", "sglang.launch_server"),
        "env_names": (),
        "engine": "sglang",
        "port": server.setup.port,
        "role": "generation",
        "reason": "an earlier run",
        "started_at": "2026-12-01T00:00:00+00:00",
        "log_path": server.log_path,
        **changes,
    }
    return ServerRecord(**fields)


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"start_ticks_delta": -1}, r"pid \d+ is another process: start time \d+ ticks, recorded \d+"),
        (
            {"cmdline": ("/venv/bin/python", "-m", "sglang.launch_server")},
            r"pid \d+ is another process: command 'sleep 300', recorded '/venv/bin/python -m sglang.launch_server'",
        ),
    ],
    ids=["reused-pid", "other-command"],
)
def test_a_process_the_pipeline_did_not_start_is_never_signalled(
    tmp_path: Path, foreign_process: subprocess.Popen[bytes], changes: dict[str, Any], why: str
) -> None:
    server, launch = managed(tmp_path, LocalHost(), fake_sglang_serving(tmp_path))
    delta = changes.pop("start_ticks_delta", 0)
    record = foreign_record(foreign_process, server, **changes)
    record = ServerRecord(**{**record.__dict__, "start_ticks": record.start_ticks + delta})
    Path(server.pid_path).parent.mkdir(parents=True, exist_ok=True)
    Path(server.pid_path).write_text(record.to_json())

    with pytest.raises(
        NotOurProcessError,
        match=rf"refusing to stop pid {foreign_process.pid}: .*but {why}\. The "
        r"pipeline did not start it, so nothing was signalled",
    ):
        server.stop("hand-over")
    assert foreign_process.poll() is None, "the foreign process was signalled"
    assert server.status().state == "foreign"

    started = server.start(launch, "generation")
    assert started.replaced is not None and "is another process" in started.replaced
    server.stop("done")
    assert foreign_process.poll() is None


def test_a_server_that_dies_during_startup_is_reported_with_its_log(tmp_path: Path) -> None:
    server, launch = managed(tmp_path, LocalHost(), dying_sglang_serving(tmp_path))
    with pytest.raises(StartupFailedError) as caught:
        server.start(launch, "generation")
    message = str(caught.value)
    assert "the generation server (pid" in message and "exited during start-up; log " in message
    assert "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB" in message
    assert "CUDA out of memory" in caught.value.log_tail
    assert server.status().state == "absent"


def test_a_server_that_never_gets_ready_is_stopped(tmp_path: Path) -> None:
    serving = fake_sglang_serving(tmp_path, startup_timeout_s=2)
    serving["env"]["FAKE_SGLANG_BIND"] = "0"  # it never listens
    server, launch = managed(tmp_path, LocalHost(), serving)
    with pytest.raises(StartupFailedError, match=r"did not get ready within 2 s \(unhealthy: ") as caught:
        server.start(launch, "generation")
    stop = caught.value.stop
    assert stop is not None and stop.verified and stop.signals == ("TERM",)
    assert processes_of(stop.pid or 0) == []


def test_a_crashed_group_is_exited_and_starts_again(tmp_path: Path) -> None:
    server, launch = managed(tmp_path, LocalHost(), fake_sglang_serving(tmp_path))
    first = server.start(launch, "generation")
    os.killpg(first.pid, signal.SIGKILL)
    # SIGKILL is delivered, not waited for: the group's processes go within moments, not at once.
    wait_until(lambda: server.status().state == "exited", 10, "the group's death")
    status = server.status()
    assert status.state == "exited" and f"pid {first.pid} is gone" in status.detail

    again = server.start(launch, "restart after a crash")
    assert again.pid != first.pid and again.replaced is not None
    stopped = server.stop("done")
    assert stopped.verified


def test_processes_left_by_a_dead_leader_are_stopped_by_their_record(tmp_path: Path) -> None:
    server, launch = managed(tmp_path, LocalHost(), fake_sglang_serving(tmp_path))
    started = server.start(launch, "generation")
    os.kill(started.pid, signal.SIGKILL)
    wait_until(lambda: server.status().state == "orphaned", 10, "the leader's death")
    with pytest.raises(ManagedServerError, match=r"processes of the previous server are left .*; stop it first"):
        server.start(launch, "generation")
    stopped = server.stop("clean up after a crash")
    assert stopped.verified and stopped.signals == ("TERM",)
    assert processes_of(started.pid) == []


def test_a_port_held_by_another_process_is_named_and_left_alone(tmp_path: Path) -> None:
    port = free_port()
    server, launch = managed(tmp_path, LocalHost(), fake_sglang_serving(tmp_path, port=port))
    with socket.create_server(("127.0.0.1", port)):
        with pytest.raises(
            PortInUseError,
            match=rf"port {port} is already in use by pid {os.getpid()} \(\S+\); the "
            r"pipeline did not start that process and leaves it alone",
        ):
            server.start(launch, "generation")
        with pytest.raises(
            StopNotVerifiedError,
            match=rf"no server of the pipeline's is running .*port {port} still "
            rf"listening, held by pid {os.getpid()}",
        ):
            server.stop("hand-over")
    assert server.stop("hand-over").verified
