"""Fixtures for the compute tests: where the local and remote artifacts live, and idle GPUs on the loopback
sshd's scripted nvidia-smi (this machine has no GPU; the sshd is the root conftest's). Their pipeline files:
`compute/pipelines.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.testing.sshd_fixture import FakeBin
from eagle3_pipeline_tests.compute.pipelines import Layout, idle_gpu_rows


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    return Layout(local=tmp_path / "local", remote=tmp_path / "host" / "artifacts", workdir=tmp_path / "host" / "work")


@pytest.fixture
def idle_gpus(fakebin: FakeBin) -> Any:
    fakebin.reset()
    fakebin.set_gpus(idle_gpu_rows())
    yield fakebin
    fakebin.reset()
