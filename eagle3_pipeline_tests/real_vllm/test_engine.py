"""The vLLM environment itself: the server starts, generates, and the hidden-state connector writes on the CPU
(the eagle3-vllm-cpu plugin); stopping it leaves no process of its group."""

from __future__ import annotations

import fcntl
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from eagle3_pipeline.testing.real_vllm import extraction_args, group_alive, vllm_server

pytestmark = pytest.mark.local_model


def test_extraction_server_writes_states_on_cpu(real_vllm_python: Path, local_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "states"
    folder.mkdir()
    with vllm_server(
        local_model, tmp_path / "vllm.log", served_name="smol", extra_args=extraction_args([2, 15, 27, 30], folder)
    ) as server:
        ids = [1, 2, 3, 4, 5, 6, 7]
        reply = httpx.post(
            f"{server.base_url}/completions",
            json={"model": "smol", "prompt": ids, "max_tokens": 1, "return_token_ids": True},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        path = Path(reply.json()["kv_transfer_params"]["hidden_states_path"])
        assert path.parent == folder
        tensors = read_locked(path)
        pid = server.process.pid
    assert list(tensors["hidden_states"].shape) == [len(ids), 4, 576]
    assert tensors["token_ids"].tolist() == ids
    assert not group_alive(pid), "the server's process group outlived the with block"


def read_locked(path: Path) -> dict[str, Any]:
    """The connector's file, once its writer has released the exclusive lock on ``<file>.lock``."""
    from safetensors.torch import load_file

    deadline = time.monotonic() + 60
    lock = Path(f"{path}.lock")
    while not lock.exists():
        assert time.monotonic() < deadline, f"no {lock.name}"
        time.sleep(0.05)
    with lock.open() as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        return load_file(str(path))
