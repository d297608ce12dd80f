"""Fixtures for the managed-server tests: pipeline files with a managed server, and the health tests'
loopback sshd and scripted nvidia-smi (this machine has no GPU).

The engine here is the stand-in for SGLang (`fake_sglang.FakeSglang`'s `python -m sglang.launch_server`:
a real loopback HTTP server with `sglang::scheduler_TP<i>` children in its process group; no SGLang
engine runs on this machine), started by the pipeline's own launch line with the module on PYTHONPATH.
The real-vLLM versions of the same lifecycle are under eagle3_pipeline_tests/real_vllm/.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from eagle3_pipeline.config import PipelineConfig, load_config
from eagle3_pipeline.managed import ServerRecord
from eagle3_pipeline.testing.fake_sglang import FakeSglang
from eagle3_pipeline.testing.process_tools import free_port
from eagle3_pipeline.testing.sshd_fixture import Sshd
from eagle3_pipeline_tests.health.conftest import fakebin, sshd  # noqa: F401 - shared fixtures

__all__ = ["fakebin", "sshd"]

# A stand-in for an SGLang that dies during start-up, as one does on a GPU that is already full.
_DYING_SERVER = """import sys, time
print("Loading weights took 0.5 s", flush=True)
time.sleep(0.5)
print("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 95.00 GiB total)", file=sys.stderr)
sys.exit(1)
"""


def write_pipeline(folder: Path, sections: dict[str, Any]) -> PipelineConfig:
    """A pipeline file with ``sections`` over a minimal base (a target, a dataset, floors any machine meets)."""
    (folder / "B1.jsonl").write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n')
    data: dict[str, Any] = {
        "name": "managed",
        "artifacts_root": str(folder / "artifacts"),
        "target": {"model": "target", "tokenizer": str(folder)},
        "health": {"min_disk_free_gb": 0.01, "min_mem_free_gb": 0.01},
        "datasets": [{"id": "B1", "source": "B1.jsonl"}],
        **sections,
    }
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_config(path, runtime_checks=False)


def fake_sglang_serving(folder: Path, tp_size: int = 2, **overrides: Any) -> dict[str, Any]:
    """A managed `serving` section whose engine is the SGLang stand-in."""
    fake = FakeSglang(folder / "engine", tp_size=tp_size)
    section: dict[str, Any] = {
        "managed": True,
        "engine": "sglang",
        "python": sys.executable,
        "model": "/models/target",
        "tp_size": tp_size,
        "port": free_port(),
        "log_dir": str(folder / "logs"),
        "stop_grace_s": 10,
        "gpu_release_timeout_s": 0,
        "env": {
            "PYTHONPATH": str(fake.workdir / "pythonpath"),
            "FAKE_SGLANG_SCENARIO": str(fake.scenario_path),
            "FAKE_SGLANG_READY": str(folder / "engine" / "ready"),
        },
    }
    return {**section, **overrides}


def dying_sglang_serving(folder: Path) -> dict[str, Any]:
    """A managed `serving` section whose engine exits during start-up with a CUDA error in its log."""
    package = folder / "dying" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(_DYING_SERVER)
    return fake_sglang_serving(folder, env={"PYTHONPATH": str(folder / "dying")})


def ssh_health(sshd: Sshd, **overrides: Any) -> dict[str, Any]:  # noqa: F811 - the imported fixture's name
    """The health section of a pipeline whose GPU host is the loopback sshd."""
    return {
        "host": {
            "kind": "ssh",
            "hostname": "127.0.0.1",
            "port": sshd.port,
            "key_file": str(sshd.client_key),
            "known_hosts": str(sshd.known_hosts),
            "allow_agent": False,
        },
        "min_disk_free_gb": 0.01,
        "min_mem_free_gb": 0.01,
        **overrides,
    }


@pytest.fixture
def stop_servers(tmp_path: Path) -> Iterator[None]:
    """After the test, the process group of every stand-in still recorded in a pid file under ``tmp_path/logs``
    (the ``log_dir`` of :func:`fake_sglang_serving`) is killed: a test that fails midway leaves none running."""
    yield
    for path in (tmp_path / "logs").glob("managed-*.json"):
        record = ServerRecord.from_json(path.read_text())
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record.pgid, signal.SIGKILL)
