"""A managed server's GPUs measured on memory, and its graceful stop, on this machine with the SGLang stand-in
as the engine (conftest) and the scripted nvidia-smi standing in for the GPUs (no GPU here): a start on busy
GPUs is refused naming the holders; a stop whose GPU memory stays used (nvidia-smi listing no pid of the
server, as in another PID namespace) is refused with the per-GPU figures; the stop's SIGTERM goes to the
leader first, which shuts its scheduler children down itself, and to the group only when it does not."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.hosts import LocalHost
from eagle3_pipeline.managed import LaunchLine, ManagedServer, StopNotVerifiedError, launch_for, managed_server
from eagle3_pipeline.managed.errors import GpusBusyError
from eagle3_pipeline.managed.gpu_memory import GpuMemory, busy, not_released
from eagle3_pipeline.managed.launch import ServerPurpose
from eagle3_pipeline.testing.process_groups import processes_of
from eagle3_pipeline.testing.sshd_fixture import FakeBin, gpu_row, idle_gpu_rows
from eagle3_pipeline_tests.managed.pipelines import fake_sglang_serving
from eagle3_pipeline_tests.pipeline_files import load_pipeline

GENERATION = ServerPurpose.generation(needs_tools=False)
pytestmark = pytest.mark.usefixtures("stop_servers")


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """These tests start `python -m sglang.launch_server` stand-ins, which the health tests look for."""


@pytest.fixture
def gpu_host(fakebin: FakeBin) -> Iterator[LocalHost]:
    """This machine with the scripted nvidia-smi first on PATH: 8 GPUs nobody holds."""
    fakebin.reset()
    fakebin.set_gpus(idle_gpu_rows())
    yield LocalHost(env={"PATH": f"{fakebin.dir}:{os.environ['PATH']}"})
    fakebin.reset()


def server_on(
    tmp_path: Path, host: LocalHost, env: dict[str, str] | None = None, gpus: int = 8, **serving: Any
) -> tuple[ManagedServer, LaunchLine]:
    """The managed stand-in on ``host`` with ``gpus`` GPUs declared, and its launch line for generation."""
    section = fake_sglang_serving(tmp_path, **serving)
    section["env"].update(env or {})
    config = load_pipeline(tmp_path, {"serving": section, "health": {"expected_gpus": gpus}})
    setup = managed_server(config)
    assert setup is not None
    return ManagedServer(host, setup), launch_for(config.target, setup, GENERATION)


def test_a_start_on_busy_gpus_is_refused_naming_the_holders(
    tmp_path: Path, gpu_host: LocalHost, fakebin: FakeBin
) -> None:
    holder = subprocess.Popen(["sleep", "300"])  # a process that is not the pipeline's, as nvidia-smi lists it
    try:
        fakebin.set_gpus([gpu_row(0, used=81000), gpu_row(1, used=81000), *idle_gpu_rows(8)[2:]])
        fakebin.set_compute_apps([f"{holder.pid}, 80990"])
        server, launch = server_on(tmp_path, gpu_host)
        with pytest.raises(GpusBusyError) as caught:
            server.start(launch, "generation")
        message = str(caught.value)
        print(message)
        assert (
            "the GPUs are not free: GPU 0 81000 MiB used, GPU 1 81000 MiB used (more than serving.gpu_free_mib = "
            f"2048); held by pid {holder.pid} (sleep, 80990 MiB)" in message
        )
        assert holder.poll() is None and server.status().state == "absent"
        assert not Path(server.log_path).exists(), "nothing was launched"
    finally:
        holder.kill()
        holder.wait()


def test_a_stop_whose_gpu_memory_stays_used_is_refused_with_the_figures(
    tmp_path: Path, gpu_host: LocalHost, fakebin: FakeBin
) -> None:
    """nvidia-smi lists no pid of the server (another PID namespace), but GPUs 0 and 1 stay used."""
    server, launch = server_on(tmp_path, gpu_host, gpu_release_timeout_s=1)
    started = server.start(launch, "generation")
    assert started.gpu_check == "ok: 8 GPU(s) free, MiB used: 5, 5, 5, 5, 5, 5, 5, 5 (the baseline)"
    record = server.read_record()
    assert record is not None and record.gpu_baseline == tuple((i, 5.0) for i in range(8))
    fakebin.set_gpus([gpu_row(0, used=70000), gpu_row(1, used=1500), *idle_gpu_rows(8)[2:]])
    with pytest.raises(StopNotVerifiedError) as caught:
        server.stop("hand the GPUs to training")
    message = str(caught.value)
    print(message)
    assert (
        "GPU memory not back to the baseline: GPU 0 70000 MiB (baseline 5 MiB), GPU 1 1500 MiB (baseline 5 MiB) "
        "(nvidia-smi --query-gpu=memory.used; baseline from the start, tolerance 1024 MiB)" in message
    )
    verification = caught.value.result.verification
    assert verification.gpu_memory == ((0, 70000.0, 5.0), (1, 1500.0, 5.0)) and not verification.gpu_holders
    assert processes_of(started.pid) == [], "the processes are gone; only the memory is held"

    fakebin.set_gpus(idle_gpu_rows())  # the memory comes back: the stop is verified
    assert server.stop("again").verified


def test_gpu_memory_figures() -> None:
    reading = GpuMemory(((0, 5.0), (1, 3000.0)))
    assert busy(reading, 2048) == [(1, 3000.0)]
    assert not_released([(0, 900.0), (1, 1100.0)], [(0, 5.0), (1, 5.0)], 1024, 2048) == [(1, 1100.0, 5.0)]
    assert not_released([(0, 3000.0)], None, 1024, 2048) == [(0, 3000.0, 2048)]  # no baseline: the free threshold


def test_the_stop_terms_the_leader_first_which_shuts_its_children_down(tmp_path: Path) -> None:
    server, launch = server_on(tmp_path, LocalHost(), gpus=0)
    started = server.start(launch, "generation")
    assert len(started.members) == 3
    stopped = server.stop("hand the GPUs to training")
    assert stopped.verified and stopped.signals == ("TERM",), "the leader's SIGTERM was enough"
    log = Path(server.log_path).read_text()
    assert "Received SIGTERM: shutting down the scheduler processes" in log
    assert "Shut down 2 scheduler process(es); exiting" in log
    assert processes_of(started.pid) == []


def test_a_leader_that_leaves_its_children_is_followed_by_the_group(tmp_path: Path) -> None:
    server, launch = server_on(tmp_path, LocalHost(), {"FAKE_SGLANG_ABANDON": "1"}, gpus=0, stop_grace_s=6)
    started = server.start(launch, "generation")
    stopped = server.stop("hand the GPUs to training")
    assert stopped.verified and stopped.signals == ("TERM", "TERM group")
    assert "exiting, the scheduler processes left running" in Path(server.log_path).read_text()
    assert processes_of(started.pid) == []
