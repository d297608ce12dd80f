"""A managed real vLLM (CPU build, the embedded model) started from the pipeline's own launch line: start →
ready on the health tick → a generation → stop, verified (no process of its group left, port closed), over
SSH (the loopback sshd logs into this same machine; its scripted nvidia-smi stands in for the GPUs) — there
closed as on the real box: bound to the host's 127.0.0.1, reached through the SSH tunnel under a name that
resolves nowhere (``gpu-box.test``), and keyed (``serving.api_key_env``: the key in its ``--config`` file, a
request without it refused by vLLM, the pipeline's own clients sending it); and on
this machine the builder's extraction line, whose connector (the eagle3-vllm-cpu plugin's CPU path) writes
the store's layers. The main job (test_main_job.py) starts and stops it on this machine five times more."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.hidden_states.store import default_aux_layer_ids
from eagle3_pipeline.hosts import TUNNELS, Host, LocalHost, reach
from eagle3_pipeline.managed import ManagedServer, ServerPurpose, StartResult, StopResult, launch_for, managed_server
from eagle3_pipeline.managed.tunnels import declare_tunnels
from eagle3_pipeline.target.layer_ids import extraction_layer_ids
from eagle3_pipeline.testing.process_groups import processes_of
from eagle3_pipeline.testing.real_vllm import free_port, managed_serving
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd
from eagle3_pipeline_tests.pipeline_files import load_pipeline

pytestmark = pytest.mark.local_model
KEY_VAR = "EAGLE3_TEST_VLLM_KEY"
KEY = "sk-vllm-real-5e8d21c0"


def pipeline(
    folder: Path, python: Path, model: Path, health: dict[str, Any] | None = None, **serving: Any
) -> PipelineConfig:
    """A pipeline whose managed server is the real vLLM with the CPU settings (eager, bf16, 1 GiB KV cache);
    ``serving``: more of its settings."""
    port = serving.pop("port", None) or free_port()
    sections = {
        "name": "managed_vllm",
        "target": {"model": "smol", "tokenizer": str(model)},
        "serving": managed_serving(python, model, port, folder / "logs", bind_host="127.0.0.1", **serving),
        "health": {"generation_timeout_s": 30, **(health or {})},
    }
    return load_pipeline(folder, sections)


def lifecycle(config: PipelineConfig, host: Host) -> tuple[StartResult, str, StopResult]:
    """Start for generation, ask one chat completion, stop; returns the two results and the answer."""
    setup = managed_server(config)
    assert setup is not None
    server = ManagedServer(host, setup)
    assert server.status().state == "absent"
    started = server.start(launch_for(config.target, setup, ServerPurpose.generation(needs_tools=False)), "generation")
    try:
        url = reach(f"{setup.base_url}/chat/completions")
        body = {"model": "smol", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        key = setup.api_key()
        if key is not None:
            refused = httpx.post(url, json=body, timeout=120)
            assert refused.status_code == 401, f"vLLM answered a request without the key: {refused.text}"
        reply = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=120)
        assert reply.status_code == 200, reply.text
        answer = str(reply.json()["choices"][0]["message"]["content"])
        status = server.status()
        assert status.state == "running" and status.record is not None
        assert status.record.cmdline == status.record.argv  # vLLM's API server keeps its command line
    finally:
        stopped = server.stop("generation done")
    return started, answer, stopped


def report(where: str, started: StartResult, stopped: StopResult) -> None:
    print(f"\n{where}: start {json.dumps(started.as_metadata())}\n{where}: stop {json.dumps(stopped.as_metadata())}")


def test_managed_vllm_over_ssh(
    real_vllm_python: Path,
    local_model: Path,
    tmp_path: Path,
    sshd: Sshd,
    fakebin: FakeBin,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fakebin.reset()
    monkeypatch.setenv(KEY_VAR, KEY)
    port = free_port()
    health = {
        "host": {
            "kind": "ssh",
            "hostname": "127.0.0.1",
            "port": sshd.port,
            "key_file": str(sshd.client_key),
            "known_hosts": str(sshd.known_hosts),
            "allow_agent": False,
        }
    }
    url = f"http://gpu-box.test:{port}/v1"
    config = pipeline(tmp_path, real_vllm_python, local_model, health, port=port, base_url=url, api_key_env=KEY_VAR)
    assert declare_tunnels(config) == [url]
    host = sshd.host()
    try:
        started, answer, stopped = lifecycle(config, host)
    finally:
        host.close()
        TUNNELS.forget()
    report("ssh", started, stopped)
    assert "--host 127.0.0.1" in started.command and "--config" in started.command
    logs = [path.read_text() for path in (tmp_path / "logs").iterdir() if path.is_file()]
    assert logs and not [text for text in logs if KEY in text] and KEY not in json.dumps(started.as_metadata())
    assert started.host == f"127.0.0.1:{sshd.port}" and answer
    assert stopped.verified and stopped.verification.gpu_check.startswith("ok: nvidia-smi lists 0 compute")
    assert processes_of(started.pid) == []


def test_the_builders_extraction_line_serves_the_stores_layers(
    real_vllm_python: Path, local_model: Path, tmp_path: Path
) -> None:
    config = pipeline(tmp_path, real_vllm_python, local_model)
    setup = managed_server(config)
    assert setup is not None
    folder = tmp_path / "states"
    folder.mkdir()
    layers = extraction_layer_ids("llama", default_aux_layer_ids(30), 30)
    server = ManagedServer(LocalHost(), setup)
    started = server.start(
        launch_for(config.target, setup, ServerPurpose.extraction_of(layers, str(folder))), "extraction"
    )
    try:
        ids = [1, 2, 3, 4, 5, 6, 7]
        reply = httpx.post(
            f"{setup.base_url}/completions",
            json={"model": "smol", "prompt": ids, "max_tokens": 1, "return_token_ids": True},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        path = Path(reply.json()["kv_transfer_params"]["hidden_states_path"])
        assert path.parent == folder
    finally:
        stopped = server.stop("extraction done")
    report("extraction", started, stopped)
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    assert list(tensors["hidden_states"].shape) == [len(ids), 4, 576] and tensors["token_ids"].tolist() == ids
    assert started.report.healthy
    assert stopped.verified and stopped.was_running and stopped.signals == ("TERM",)
    assert stopped.verification.gpu_check == "skipped: no nvidia-smi on the host and health.expected_gpus is 0"
    assert processes_of(started.pid) == []
    assert os.path.exists(server.log_path)
