"""Fixtures for the health tests: a real sshd, fake GPU tools and a fake SGLang process tree.

See `sshd_fixture` for what each stand-in is. This machine has no GPU: `FakeBin` stands in for
`nvidia-smi` and `dmesg` on the SSH host's PATH.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_pipeline.hosts import SshHost
from eagle3_pipeline.testing.fake_sglang import FakeSglang
from eagle3_pipeline.testing.sshd_fixture import SSHD, FakeBin, Sshd, Watched, make_watched


@pytest.fixture(scope="session")
def fakebin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeBin]:
    fake = FakeBin(tmp_path_factory.mktemp("fakebin"))
    yield fake
    fake.release_wedged()


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory, fakebin: FakeBin) -> Iterator[Sshd]:
    if not Path(SSHD).exists():
        pytest.fail(f"{SSHD} is missing: apt-get install -y openssh-server")
    missing = [tool for tool in ("ss", "ps", "pgrep", "ssh-keygen", "timeout") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the health probes need {', '.join(missing)}: apt-get install -y iproute2 procps openssh-client")
    if os.geteuid() != 0:
        pytest.fail("the sshd fixture runs sshd with privilege separation and needs root")
    server = Sshd(tmp_path_factory.mktemp("sshd"), fakebin.dir).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ssh_host(sshd: Sshd) -> Iterator[SshHost]:
    """One connection shared by the tick tests, as a sensor's host resource would be."""
    host = sshd.host()
    yield host
    host.close()


@pytest.fixture
def gpus(fakebin: FakeBin) -> Iterator[FakeBin]:
    fakebin.reset()
    yield fakebin
    fakebin.reset()


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """Every health test reads the machine's process table (see the root conftest)."""


@pytest.fixture
def sglang(tmp_path: Path) -> Iterator[FakeSglang]:
    server = FakeSglang(tmp_path / "sglang")
    yield server
    server.stop()


@pytest.fixture
def watched(tmp_path: Path) -> Watched:
    return make_watched(tmp_path)
