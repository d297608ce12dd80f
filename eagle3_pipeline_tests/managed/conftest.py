"""Fixtures for the managed-server tests (their pipeline files: `managed/pipelines.py`; the loopback sshd and
scripted nvidia-smi, for this machine has no GPU: the root conftest).

The engine here is the stand-in for SGLang (`fake_sglang.FakeSglang`'s `python -m sglang.launch_server`:
a real loopback HTTP server with `sglang::scheduler_TP<i>` children in its process group; no SGLang
engine runs on this machine), started by the pipeline's own launch line with the module on PYTHONPATH.
The real-vLLM versions of the same lifecycle are under eagle3_pipeline_tests/real_vllm/.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_pipeline.managed import ServerRecord


@pytest.fixture
def stop_servers(tmp_path: Path) -> Iterator[None]:
    """After the test, the process group of every stand-in still recorded in a pid file under ``tmp_path/logs``
    (the ``log_dir`` of :func:`fake_sglang_serving`) is killed: a test that fails midway leaves none running."""
    yield
    for path in (tmp_path / "logs").glob("managed-*.json"):
        record = ServerRecord.from_json(path.read_text())
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record.pgid, signal.SIGKILL)
