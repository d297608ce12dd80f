"""Every command ends in one line saying what is wrong and what to do, with its documented exit code, and no
traceback unless `--debug`: an unreachable host, an unknown or changed host key and a refused key (the loopback
sshd), a pipeline file whose prompt files and API key are absent here, and an error no command expects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from eagle3_pipeline.cli import main
from eagle3_pipeline.cli.errors import ExitCode
from eagle3_pipeline.testing.process_tools import free_port
from eagle3_pipeline.testing.sshd_fixture import Sshd


def cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`eagle3-pipeline ARGS` as a process, with a Dagster home of its own."""
    return subprocess.run(
        [sys.executable, "-m", "eagle3_pipeline.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def pipeline(folder: Path, host: dict[str, Any], **sections: Any) -> Path:
    """A pipeline whose GPU host (health and the managed server) is ``host``; length by characters, no tokenizer."""
    (folder / "B1.jsonl").write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n')
    document: dict[str, Any] = {
        "name": "errors",
        "target": {"model": "target", "tokenizer": str(folder)},
        "serving": {"managed": True, "engine": "sglang", "python": sys.executable, "model": "/m", "port": free_port()},
        "generation": {"length_estimator": "chars"},
        "health": {
            "host": {"kind": "ssh", "connect_timeout_s": 3, **host},
            "min_disk_free_gb": 0,
            "min_mem_free_gb": 0,
        },
        "datasets": [{"id": "B1", "source": "B1.jsonl"}],
        **sections,
    }
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def closed_port_host() -> dict[str, Any]:
    return {"hostname": "127.0.0.1", "port": free_port(), "username": "eagle3", "allow_agent": False}


def sshd_host(sshd: Sshd, **overrides: Any) -> dict[str, Any]:
    settings = {
        "hostname": "127.0.0.1",
        "port": sshd.port,
        "username": "root",
        "key_file": str(sshd.client_key),
        "known_hosts": str(sshd.known_hosts),
        "allow_agent": False,
    }
    return {**settings, **overrides}


def one_line(done: subprocess.CompletedProcess[str], code: int) -> str:
    """The command's stderr: exactly one line, no traceback; its exit code ``code``."""
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("eagle3-pipeline: "), line
    return line


@pytest.mark.parametrize("action", ["status", "stop"])
def test_server_on_an_unreachable_host(tmp_path: Path, action: str) -> None:
    config = pipeline(tmp_path, closed_port_host())
    line = one_line(cli("server", action, "--config", str(config)), ExitCode.HOST_UNREACHABLE)
    assert line.startswith(f"eagle3-pipeline: {config}: cannot connect to eagle3@127.0.0.1:"), line
    assert line.endswith("check the host's hostname and port, and that it is up and reachable from here"), line


def test_an_unresolvable_host_name(tmp_path: Path) -> None:
    config = pipeline(tmp_path, {**closed_port_host(), "hostname": "gpu-box.invalid"})
    line = one_line(cli("server", "status", "--config", str(config)), ExitCode.HOST_UNREACHABLE)
    assert "cannot connect to eagle3@gpu-box.invalid:" in line, line


def test_debug_prints_the_traceback_then_the_same_line(tmp_path: Path) -> None:
    config = pipeline(tmp_path, closed_port_host())
    done = cli("--debug", "server", "status", "--config", str(config))
    assert done.returncode == ExitCode.HOST_UNREACHABLE
    assert done.stderr.startswith("Traceback") and "HostConnectError" in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"eagle3-pipeline: {config}: cannot connect to"), done.stderr


def test_an_unknown_host_key(tmp_path: Path, sshd: Sshd) -> None:
    known_hosts = tmp_path / "known_hosts"
    config = pipeline(tmp_path, sshd_host(sshd, known_hosts=str(known_hosts)))
    line = one_line(cli("server", "status", "--config", str(config)), ExitCode.HOST_KEY)
    assert f"unknown host key for [127.0.0.1]:{sshd.port} (ssh-ed25519 SHA256:" in line, line
    assert f"ssh-keyscan -p {sshd.port} 127.0.0.1 >> {known_hosts}" in line, line
    assert "trust_on_first_use: true" in line, line


def test_a_changed_host_key(tmp_path: Path, sshd: Sshd) -> None:
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    known_hosts = tmp_path / "known_hosts"
    kind, key = other.with_suffix(".pub").read_text().split()[:2]
    known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {kind} {key}\n")
    config = pipeline(tmp_path, sshd_host(sshd, known_hosts=str(known_hosts)))
    line = one_line(cli("server", "stop", "--config", str(config)), ExitCode.HOST_KEY)
    assert f"host key for [127.0.0.1]:{sshd.port} changed" in line and "refusing to connect" in line, line
    assert f"ssh-keygen -R '[127.0.0.1]:{sshd.port}' -f {known_hosts}" in line, line


def test_a_refused_key(tmp_path: Path, sshd: Sshd) -> None:
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    config = pipeline(tmp_path, sshd_host(sshd, key_file=str(stranger)))
    line = one_line(cli("server", "status", "--config", str(config)), ExitCode.HOST_AUTH)
    assert f"authentication failed for root@127.0.0.1:{sshd.port}: key {stranger} refused" in line, line
    assert "check the host's username and key_file" in line, line


def test_run_on_an_unreachable_host_names_it_and_exits_4(tmp_path: Path) -> None:
    config = pipeline(tmp_path, closed_port_host())
    done = cli("run", "--config", str(config), env={"DAGSTER_HOME": str(tmp_path / "home")})
    assert done.returncode == ExitCode.HOST_UNREACHABLE, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stdout + done.stderr and "Stack Trace" not in done.stderr
    cause = next(line for line in done.stderr.splitlines() if line.startswith("eagle3-pipeline: run "))
    assert "HostConnectError: cannot connect to eagle3@127.0.0.1:" in cause, cause
    assert cause.endswith("check the host's hostname and port, and that it is up and reachable from here"), cause
    assert done.stdout.startswith(f"artifacts: {tmp_path / 'artifacts' / 'errors'}\n"), done.stdout[:500]


def test_status_reports_an_unreachable_host_as_findings(tmp_path: Path) -> None:
    config = pipeline(tmp_path, closed_port_host())
    done = cli("status", "--config", str(config), env={"DAGSTER_HOME": str(tmp_path / "home")})
    assert done.returncode == ExitCode.UNHEALTHY and done.stderr == "", done.stdout + done.stderr
    assert "Traceback" not in done.stdout
    assert "UNKNOWN  disk" in done.stdout and "reachable from here" in done.stdout, done.stdout
    assert done.stdout.splitlines()[-1] == f"artifacts: {tmp_path / 'artifacts' / 'errors'}"


def test_status_on_a_file_whose_prompts_and_key_are_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run` refuses such a file (exit 2); `status` reports the missing source and the unset key as findings."""
    monkeypatch.delenv("EAGLE3_TEST_ROUTER_KEY", raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    endpoint = {"base_url": f"http://127.0.0.1:{free_port()}/v1", "api_key_env": "EAGLE3_TEST_ROUTER_KEY"}
    document = {
        "name": "elsewhere",
        "target": {"model": "m", "tokenizer": "unused"},
        "inference": {"kind": "endpoints", "endpoints": [endpoint]},
        "health": {"expected_gpus": 0, "min_disk_free_gb": 0, "min_mem_free_gb": 0, "generation_timeout_s": 3},
        "datasets": [{"id": "B1", "source": "/nonexistent/prompts/B1.jsonl"}],
    }
    config = tmp_path / "pipeline.yaml"
    config.write_text(json.dumps(document))

    assert main(["run", "--config", str(config)]) == ExitCode.BAD_INPUT
    assert "/nonexistent/prompts/B1.jsonl' does not exist" in capsys.readouterr().err

    assert main(["status", "--config", str(config)]) == ExitCode.UNHEALTHY
    out, err = capsys.readouterr()
    assert err == "", err
    assert "CRITICAL generation" in out and "API key variable EAGLE3_TEST_ROUTER_KEY is not set" in out, out
    assert "datasets[0] (id 'B1').source: file '/nonexistent/prompts/B1.jsonl' does not exist" in out, out

    assert main(["status", "--config", str(config), "--json"]) == ExitCode.UNHEALTHY
    document = json.loads(capsys.readouterr().out)
    [dataset] = document["datasets"]
    assert (
        dataset["source_problem"] == "datasets[0] (id 'B1').source: file '/nonexistent/prompts/B1.jsonl' does not exist"
    )
    assert {c["name"]: c["status"] for c in document["checks"]}["generation"] == "critical"


def test_an_unexpected_error_is_one_line_with_exit_70(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: object) -> int:
        raise KeyError("no_such_key")

    monkeypatch.setattr("eagle3_pipeline.cli.cmd_plan", broken)
    assert main(["plan"]) == ExitCode.UNEXPECTED
    [line] = capsys.readouterr().err.splitlines()
    assert line == (
        "eagle3-pipeline: unexpected KeyError: 'no_such_key' (rerun with --debug before the command for the "
        "traceback, and report it with that traceback)"
    )


def test_plan_from_two_folders_uses_one_artifacts_root(tmp_path: Path) -> None:
    config = pipeline(tmp_path, closed_port_host())
    roots = set()
    for name in ("one", "two"):
        cwd = tmp_path / name
        cwd.mkdir()
        done = cli("plan", "--config", os.path.relpath(config, cwd), cwd=cwd)
        assert done.returncode == 0, done.stderr
        roots.add(done.stdout.splitlines()[-1])
    assert roots == {f"artifacts: {tmp_path / 'artifacts' / 'errors'}"}
