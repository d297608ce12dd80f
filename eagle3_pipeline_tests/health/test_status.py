"""`eagle3-pipeline status` as a real process: health over SSH, progress from real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from eagle3_pipeline_tests.health.pipeline_files import write_config
from eagle3_pipeline_tests.health.sshd_fixture import FakeBin, FakeSglang, Sshd, healthy_gpu_rows


def status(config_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DAGSTER_HOME": str(config_path.parent / "no_home")}
    return subprocess.run(
        [sys.executable, "-m", "eagle3_pipeline.cli", "status", "--config", str(config_path), *extra],
        capture_output=True, text=True, env=env, timeout=60,
    )


def test_json_shape_progress_and_exit_code_when_healthy(tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin) -> None:
    sglang.start()
    config = write_config(tmp_path, sshd, sglang)
    checkpoint = tmp_path / "out" / "responses" / "B1.checkpoint.jsonl"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text(
        '{"id": "a", "completion_tokens": 7}\n{"id": "b", "completion_tokens": 5}\n{"id": "a", "completion_tokens": 7}\n{"id": "c", "compl'
    )
    result = status(config.source_file, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)
    assert set(document) == {"overall", "checks", "datasets"}
    assert document["overall"] in ("ok", "warn")
    assert all(set(c) == {"name", "status", "detail", "host"} for c in document["checks"])
    assert {c["name"] for c in document["checks"]} >= {"server_process", "port", "generation", "throughput", "gpus", "disk"}
    b1, b2 = document["datasets"]
    assert set(b1) == {"id", "prompts", "responses", "completion_tokens", "token_budget", "last_write_age_s"}
    assert (b1["id"], b1["responses"], b1["completion_tokens"]) == ("B1", 2, 12)
    assert b1["last_write_age_s"] >= 0 and b2["responses"] == 0 and b2["last_write_age_s"] is None
    assert checkpoint.read_text().endswith('"compl'), "status never cuts a line a running generation is writing"


def test_table_and_exit_code_1_when_critical(tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin) -> None:
    sglang.start(ranks=7)
    gpus.set_gpus(healthy_gpu_rows(8))
    result = status(write_config(tmp_path, sshd, sglang).source_file)
    assert result.returncode == 1
    assert result.stdout.startswith("health: CRITICAL")
    assert "7 of 8" in result.stdout and "runs in progress: none" in result.stdout


def test_unknown_is_exit_code_1(tmp_path: Path, sshd: Sshd, sglang: FakeSglang, gpus: FakeBin) -> None:
    sglang.start()
    gpus.set_fields(["index", "name", "memory.used"])
    result = status(write_config(tmp_path, sshd, sglang).source_file, "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout)["overall"] in ("unknown", "critical")
    assert {c["name"]: c["status"] for c in json.loads(result.stdout)["checks"]}["gpus"] == "unknown"


def test_bad_config_is_exit_code_2(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("name: x\n")
    result = status(path)
    assert result.returncode == 2 and "p.yaml" in result.stderr and "Traceback" not in result.stderr
