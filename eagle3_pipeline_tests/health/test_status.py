"""`eagle3-pipeline status` as a real process: health over SSH, progress from real files, and the
endpoints work is sent to asked for a real completion even with no `health.server` section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import load_config
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline.testing.fake_sglang import FakeSglang
from eagle3_pipeline.testing.process_tools import free_port
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd, healthy_gpu_rows
from eagle3_pipeline_tests.dagster_runs import sensor_resources
from eagle3_pipeline_tests.health.pipeline_files import sensed_sections
from eagle3_pipeline_tests.pipeline_files import load_pipeline, write_pipeline


def status(config_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DAGSTER_HOME": str(config_path.parent / "no_home")}
    return subprocess.run(
        [sys.executable, "-m", "eagle3_pipeline.cli", "status", "--config", str(config_path), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_json_shape_progress_and_exit_code_when_healthy(
    tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin
) -> None:
    sglang.start()
    config = load_pipeline(tmp_path, sensed_sections(tmp_path, sshd, sglang), runtime_checks=True)
    checkpoint = tmp_path / "out" / "responses" / "B1.checkpoint.jsonl"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text(
        '{"id": "a", "completion_tokens": 7}\n{"id": "b", "completion_tokens": 5}\n'
        '{"id": "a", "completion_tokens": 7}\n{"id": "c", "compl'
    )
    result = status(config.source_file, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)
    assert set(document) == {"overall", "checks", "datasets"}
    assert document["overall"] in ("ok", "warn")
    assert all(set(c) == {"name", "status", "detail", "host", "required"} for c in document["checks"])
    assert {c["name"] for c in document["checks"]} >= {
        "server_process",
        "port",
        "generation",
        "throughput",
        "gpus",
        "disk",
    }
    b1, b2 = document["datasets"]
    assert set(b1) == {
        "id",
        "prompts",
        "responses",
        "completion_tokens",
        "token_budget",
        "last_write_age_s",
        "source_problem",
    }
    assert b1["source_problem"] is None, "its source file is here"
    assert (b1["id"], b1["responses"], b1["completion_tokens"]) == ("B1", 2, 12)
    assert b1["last_write_age_s"] >= 0 and b2["responses"] == 0 and b2["last_write_age_s"] is None
    assert checkpoint.read_text().endswith('"compl'), "status never cuts a line a running generation is writing"


def test_table_and_exit_code_1_when_critical(tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin) -> None:
    sglang.start(ranks=7)
    gpus.set_gpus(healthy_gpu_rows(8))
    result = status(load_pipeline(tmp_path, sensed_sections(tmp_path, sshd, sglang), runtime_checks=True).source_file)
    assert result.returncode == 1
    assert result.stdout.startswith("health: CRITICAL")
    assert "7 of 8" in result.stdout and "runs in progress: none" in result.stdout


def test_unknown_is_exit_code_1(tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin) -> None:
    sglang.start()
    gpus.set_fields(["index", "name", "memory.used"])
    result = status(
        load_pipeline(tmp_path, sensed_sections(tmp_path, sshd, sglang), runtime_checks=True).source_file, "--json"
    )
    assert result.returncode == 1
    assert json.loads(result.stdout)["overall"] in ("unknown", "critical")
    assert {c["name"]: c["status"] for c in json.loads(result.stdout)["checks"]}["gpus"] == "unknown"


def test_bad_config_is_exit_code_2(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("name: x\n")
    result = status(path)
    assert result.returncode == 2 and "p.yaml" in result.stderr and "Traceback" not in result.stderr


def endpoint_sections(base_url: str) -> dict[str, Any]:
    """`inference.kind: endpoints`, this machine as the host, and no `health.server` section."""
    return {
        "name": "remote",
        "target": {"model": "fake", "tokenizer": "unused"},
        "inference": {"kind": "endpoints", "endpoints": [{"base_url": base_url}]},
        "health": {"expected_gpus": 0, "min_disk_free_gb": 0, "min_mem_free_gb": 0, "generation_timeout_s": 3},
    }


def test_dead_endpoint_without_a_server_section_is_critical(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"  # a closed port
    result = status(write_pipeline(tmp_path, endpoint_sections(dead)), "--json")
    print(result.stdout)
    assert result.returncode == 1, result.stdout + result.stderr
    document = json.loads(result.stdout)
    assert document["overall"] in ("critical", "unknown")
    generation = {c["name"]: c for c in document["checks"]}["generation"]
    assert generation["status"] == "critical" and generation["required"] is True
    assert generation["detail"] == f"connection refused for {dead}/chat/completions (server not listening)"


def test_live_endpoint_without_a_server_section_is_ok(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    result = status(write_pipeline(tmp_path, endpoint_sections(fake_openai.base_url)), "--json")
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)
    assert document["overall"] == "ok"
    assert {c["name"]: c["status"] for c in document["checks"]}["generation"] == "ok"
    assert [r["max_tokens"] for r in fake_openai.requests] == [1]


@pytest.mark.slow
def test_status_exit_code_and_sensor_agree(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    """One rule decides both; an optional check that fails gates neither."""
    dead = f"http://127.0.0.1:{free_port()}/v1"
    cases = {
        "dead": write_pipeline(tmp_path / "dead", endpoint_sections(dead)),
        "dead_but_optional": write_pipeline(
            tmp_path / "optional", endpoint_sections(dead), {"health": {"optional_checks": ["generation"]}}
        ),
        "live": write_pipeline(tmp_path / "live", endpoint_sections(fake_openai.base_url)),
    }
    for name, path in cases.items():
        exit_code = status(path).returncode
        with dg.instance_for_test() as instance:
            defs = build_definitions(load_config(path))
            sensor = defs.resolve_sensor_def("inference_health")
            context = dg.build_sensor_context(
                instance=instance, definitions=defs, resources=sensor_resources(defs, sensor)
            )
            launched = bool(sensor.evaluate_tick(context).run_requests)
        assert (exit_code == 0) is launched, name
        assert launched is (name != "dead"), name
