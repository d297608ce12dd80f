"""Closed by default, over SSH: the managed server on the GPU host (the loopback sshd; the engine is the SGLang
stand-in, fake_sglang, for no SGLang engine runs here) binds that host's 127.0.0.1, and every client of the
pipeline reaches it through the one tunnel its file declares — the readiness and health ticks' HTTP probes, a
generation request, the benchmark's client. Its URL names ``gpu-box.test``, which resolves nowhere: nothing
gets there but through the tunnel."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from eagle3_pipeline.drafter.serve.client import measure
from eagle3_pipeline.generation import Endpoint
from eagle3_pipeline.health import run_health_tick, server_root
from eagle3_pipeline.hosts import TUNNELS
from eagle3_pipeline.managed import ManagedServer, ServerPurpose, launch_for, managed_server
from eagle3_pipeline.managed.tunnels import declare_tunnels
from eagle3_pipeline.testing.process_groups import processes_of
from eagle3_pipeline.testing.process_tools import free_port
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd
from eagle3_pipeline_tests.managed.pipelines import fake_sglang_serving, ssh_health
from eagle3_pipeline_tests.pipeline_files import load_pipeline


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """These tests start `python -m sglang.launch_server` stand-ins, which the health tests look for."""


@pytest.fixture
def tunnels() -> Iterator[None]:
    yield
    TUNNELS.forget()


def test_a_server_on_the_gpu_hosts_loopback_is_reached_through_the_tunnel(
    tmp_path: Path, sshd: Sshd, fakebin: FakeBin, stop_servers: None, tunnels: None
) -> None:
    fakebin.reset()
    port = free_port()
    url = f"http://gpu-box.test:{port}/v1"
    serving = fake_sglang_serving(tmp_path, port=port, base_url=url)
    config = load_pipeline(tmp_path, {"serving": serving, "health": ssh_health(sshd)})
    setup = managed_server(config)
    assert setup is not None and setup.bind_host == "127.0.0.1" and setup.tunnelled
    assert declare_tunnels(config) == [url]
    launch = launch_for(config.target, setup, ServerPurpose.generation(needs_tools=False))
    assert launch.argv[launch.argv.index("--host") + 1] == "127.0.0.1"
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/models", timeout=5)
    host = sshd.host()
    server = ManagedServer(host, setup)
    try:
        started = server.start(launch, "generation")  # ready: the health tick's probes went through the tunnel
        assert started.report is not None and started.report.healthy
        report, _ = run_health_tick(host, setup.server_spec(), setup.thresholds)
        assert {c.name: c.status.value for c in report.checks}["generation"] == "ok", report.summary()
        endpoint = Endpoint(setup.base_url, setup.served_name)
        body = {"model": endpoint.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        reply = httpx.post(endpoint.chat_url, json=body, timeout=10)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "OK"
        measured = measure(
            "sglang",
            server_root(setup.base_url),
            prompts=[[1, 2, 3]] * 4,
            max_tokens=8,
            concurrency=2,
            timeout_s=10.0,
            speculative=False,
        )
        assert (measured.requests, measured.completion_tokens) == (4, 32)
        forward = TUNNELS.forward(url)
        assert forward is not None and forward.connections >= 4, "one forward served every client"
        stopped = server.stop("done")
        assert stopped.verified and processes_of(started.pid) == []
    finally:
        host.close()


def test_a_generation_run_reaches_the_server_on_the_gpu_hosts_loopback(
    tmp_path: Path, sshd: Sshd, fakebin: FakeBin, stop_servers: None, tunnels: None
) -> None:
    """A real Dagster run (temporary instance): the pipeline resource declares the tunnel from the file, the
    run starts the server on the SSH host, its preflight and generation requests go through the tunnel."""
    import dagster as dg

    from eagle3_pipeline.components.pipeline import GENERATION_JOB, build_definitions
    from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl

    fakebin.reset()
    port = free_port()
    serving = fake_sglang_serving(tmp_path, port=port, base_url=f"http://gpu-box.test:{port}/v1")
    Path(serving["env"]["FAKE_SGLANG_SCENARIO"]).write_text("{}")
    write_jsonl(tmp_path / "p.jsonl", [sharegpt(f"question {i}") for i in range(4)])
    health = {**ssh_health(sshd), "max_truncation_rate": 1.0}
    generation = {"length_estimator": "chars", "max_tokens": 8, "concurrency": {"short": 2, "long": 1}}
    sections = {"serving": serving, "health": health, "generation": generation}
    config = load_pipeline(tmp_path, {**sections, "datasets": [{"id": "B1", "source": "p.jsonl"}]})
    setup = managed_server(config)
    assert setup is not None and setup.tunnelled
    host = sshd.host()
    try:
        with dg.instance_for_test() as instance:
            job = build_definitions(config).resolve_job_def(GENERATION_JOB)
            result = job.execute_in_process(partition_key="B1", instance=instance, raise_on_error=False)
            assert result.success
            [materialization] = result.asset_materializations_for_node("responses")
            assert materialization.metadata["rows"].value == 4
        assert TUNNELS.forward(setup.base_url) is None, "the run's end closed its tunnel"
    finally:
        ManagedServer(host, setup).stop("test over")
        host.close()
