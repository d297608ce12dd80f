"""`RemoteRun.kill` over the loopback sshd signals a process group only while its leader is the process recorded
when it started (pid, start time, boot id in ``NAME.id``): the real start path's worker is killed; a pid that now
belongs to another process (the worker exited, the pid was reused) or a record from another boot is refused, and
that process lives on."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_pipeline.compute.remote import Fate, RemoteRun
from eagle3_pipeline.hosts import SshHost
from eagle3_pipeline.testing.process_tools import wait_until
from eagle3_pipeline.testing.sshd_fixture import Sshd
from eagle3_pipeline_tests.compute.pipelines import Layout, ssh_compute
from eagle3_pipeline_tests.pipeline_files import load_pipeline


@pytest.fixture
def remote(tmp_path: Path, sshd: Sshd) -> Iterator[tuple[RemoteRun, list[str]]]:
    layout = Layout(tmp_path / "local", tmp_path / "remote", tmp_path / "work")
    config = load_pipeline(tmp_path, ssh_compute(tmp_path, sshd, layout), runtime_checks=True)
    host: SshHost = sshd.host()
    warnings: list[str] = []
    run = RemoteRun(host, config.compute, layout.local, "run1", "import-specforge", warn=warnings.append)
    run.prepare()
    yield run, warnings
    host.close()


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process in a session of its own that the pipeline did not start (the holder of a reused pid)."""
    process = subprocess.Popen(["sleep", "300"], start_new_session=True)
    yield process
    process.kill()
    process.wait()


def _ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[19])


def _boot() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_the_started_worker_is_killed_by_its_recorded_identity(remote: tuple[RemoteRun, list[str]]) -> None:
    run, warnings = remote
    fates: list[Fate] = []
    follower = threading.Thread(target=lambda: fates.append(run.start("worker", "sleep 300", "worker.log", print)))
    follower.start()
    folder = Path(str(run.run_dir))
    wait_until(lambda: (folder / "worker.id").is_file() and (folder / "worker.id").read_text().strip(), 30, "worker.id")
    pid, ticks, boot = (folder / "worker.id").read_text().split()
    assert (int(ticks), boot) == (_ticks(int(pid)), _boot())
    fate = run.kill("worker")
    follower.join(60)
    assert not fate.running and warnings == [] and fates and not fates[0].running


def test_a_reused_pid_is_not_signalled(remote: tuple[RemoteRun, list[str]], bystander: subprocess.Popen[bytes]) -> None:
    """The worker exited (``worker.status`` says so) and its pid now belongs to the bystander."""
    run, warnings = remote
    folder = Path(str(run.run_dir))
    pid = bystander.pid
    (folder / "worker.pid").write_text(f"{pid}\n")
    (folder / "worker.id").write_text(f"{pid} {_ticks(pid) - 1} {_boot()}\n")
    (folder / "worker.status").write_text("0\n")
    fate = run.kill("worker")
    assert bystander.poll() is None and fate.running
    assert warnings == [
        f"not signalling the worker of {run.run_dir}: pid {pid} is another process now (start time "
        f"{_ticks(pid)} ticks, recorded {_ticks(pid) - 1}); nothing was signalled"
    ]


def test_a_record_of_another_boot_is_not_signalled(
    remote: tuple[RemoteRun, list[str]], bystander: subprocess.Popen[bytes]
) -> None:
    run, warnings = remote
    folder = Path(str(run.run_dir))
    pid = bystander.pid
    (folder / "worker.pid").write_text(f"{pid}\n")
    (folder / "worker.id").write_text(f"{pid} {_ticks(pid)} 00000000-0000-0000-0000-000000000000\n")
    run.kill("worker")
    assert bystander.poll() is None
    assert len(warnings) == 1 and "the host rebooted since it started" in warnings[0]
