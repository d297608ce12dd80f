"""Pipeline sections whose ``compute:`` section sends heavy phases to the loopback sshd, for the compute tests (a
helper module, not a test): the "GPU host" is this machine reached over SSH, its python this worktree's venv
python, so ``python -m eagle3_pipeline.worker`` is importable there."""

from __future__ import annotations

import getpass
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.sshd_fixture import Sshd, bus_id


def idle_gpu_rows(count: int = 8) -> list[str]:
    """nvidia-smi rows of GPUs nobody holds (5 MiB used of 143771)."""
    return [f"{i}, {bus_id(i)}, NVIDIA H200, 5, 143771, 0, 30, 0, [N/A]" for i in range(count)]


@dataclass
class Layout:
    local: Path
    remote: Path
    workdir: Path


def ssh_compute(
    folder: Path, sshd: Sshd, layout: Layout, port: int | None = None, known_hosts: Path | None = None, **compute: Any
) -> dict[str, Any]:
    """Pipeline sections sending the heavy phases to the loopback sshd (``compute``: more of its settings), and
    the one-prompt source of dataset B1, for :func:`~eagle3_pipeline_tests.pipeline_files.write_pipeline`."""
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
    return {
        "name": "remote",
        "artifacts_root": str(layout.local),
        "target": {"model": "tiny-target", "tokenizer": None},
        "compute": settings,
    }
