"""Fixtures for the health tests: a connection to the real sshd (the root conftest's), fake GPU tools and a
fake SGLang process tree.

See `sshd_fixture` for what each stand-in is. This machine has no GPU: `FakeBin` stands in for
`nvidia-smi` and `dmesg` on the SSH host's PATH.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_pipeline.hosts import SshHost
from eagle3_pipeline.testing.fake_sglang import FakeSglang
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd, Watched, make_watched


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
