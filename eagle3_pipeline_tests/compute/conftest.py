"""Fixtures for the compute tests: the health tests' real loopback sshd, whose sessions meet the
scripted nvidia-smi (this machine has no GPU), and a pipeline file whose ``compute:`` section
sends heavy phases to it. The "GPU host" is this machine reached over SSH: its python is this
worktree's venv python, so ``python -m eagle3_pipeline.worker`` is importable there."""

from __future__ import annotations

import getpass
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.config import PipelineConfig, load_config
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd, bus_id
from eagle3_pipeline_tests.conftest import sharegpt, write_jsonl
from eagle3_pipeline_tests.health.conftest import fakebin, sshd  # noqa: F401 - shared fixtures

__all__ = ["fakebin", "sshd"]


def idle_gpu_rows(count: int = 8) -> list[str]:
    """nvidia-smi rows of GPUs nobody holds (5 MiB used of 143771)."""
    return [f"{i}, {bus_id(i)}, NVIDIA H200, 5, 143771, 0, 30, 0, [N/A]" for i in range(count)]


@dataclass
class Layout:
    local: Path
    remote: Path
    workdir: Path


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    return Layout(local=tmp_path / "local", remote=tmp_path / "host" / "artifacts", workdir=tmp_path / "host" / "work")


@pytest.fixture
def idle_gpus(fakebin: FakeBin) -> Any:  # noqa: F811 - the imported fixture
    fakebin.reset()
    fakebin.set_gpus(idle_gpu_rows())
    yield fakebin
    fakebin.reset()


def write_pipeline(
    folder: Path,
    sshd: Sshd,
    layout: Layout,
    port: int | None = None,
    known_hosts: Path | None = None,
    sections: dict[str, Any] | None = None,
    **compute: Any,
) -> PipelineConfig:  # noqa: F811
    """``sections``: more top-level sections of the pipeline file (e.g. ``hidden_states``)."""
    write_jsonl(folder / "B1.jsonl", [sharegpt("question")])
    settings = {
        "kind": "ssh",
        "host": {
            "hostname": "127.0.0.1",
            "port": port or sshd.port,
            "username": getpass.getuser(),
            "key_file": str(sshd.client_key),
            "known_hosts": str(known_hosts or sshd.known_hosts),
            "connect_timeout_s": 5,
        },
        "python": sys.executable,
        "workdir": str(layout.workdir),
        "artifacts_root": str(layout.remote),
        "gpus": 2,
        "kill_grace_s": 3,
        "reconnect_timeout_s": 40,
        **compute,
    }
    document = {
        "name": "remote",
        "artifacts_root": str(layout.local),
        "target": {"model": "tiny-target"},
        "compute": settings,
        "datasets": [{"id": "B1", "source": "B1.jsonl"}],
        **(sections or {}),
    }
    path = folder / "pipeline.yaml"
    path.write_text(json.dumps(document))
    return load_config(path)
