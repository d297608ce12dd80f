"""Real vLLM servers (the CPU build) on loopback, for the ``real_vllm`` tests and the benchmarks.

The engine lives in a venv of its own, built by ``tools/vllm-cpu/build.sh`` (default: ``.vllm-venv`` in
the repository root; ``$EAGLE3_VLLM_PYTHON`` names another python). :func:`vllm_server` starts
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command fails in that build) in a process
group of its own, waits until ``GET /v1/models`` answers, and stops the whole group on exit.

Sized for a 2-core, 24 GiB machine: eager mode (no compilation: ~20 s to start instead of ~95 s),
bf16, and a 1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE``; unset, the worker reserves most of the RAM).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

VLLM_PYTHON_ENV = "EAGLE3_VLLM_PYTHON"
BUILD_SCRIPT = "tools/vllm-cpu/build.sh"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
STARTUP_TIMEOUT_S = 600.0
STOP_GRACE_S = 20.0
# Eager mode, bf16 and a short context: what a CPU test server needs (each can be overridden by extra args).
DEFAULT_ARGS = ("--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048")
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def managed_serving(python: Path, model: Path, port: int, log_dir: Path, **more: Any) -> dict[str, Any]:
    """A pipeline file's ``serving:`` section for a managed real vLLM with the CPU settings above (eager, bf16,
    1 GiB KV cache), a 30 s stop grace, 600 s to start and 5 s for the GPUs' release; ``more`` adds settings."""
    return {
        "managed": True,
        "engine": "vllm",
        "python": str(python),
        "model": str(model),
        "port": port,
        "extra_args": list(DEFAULT_ARGS),
        "env": dict(DEFAULT_ENV),
        "log_dir": str(log_dir),
        "stop_grace_s": 30,
        "startup_timeout_s": 600,
        "gpu_release_timeout_s": 5,
        **more,
    }


class VllmUnavailable(RuntimeError):
    """The vLLM venv is not built on this machine."""


class VllmStartError(RuntimeError):
    """The server exited or did not answer in time; the message carries its log tail."""


def repository_root() -> Path:
    return Path(__file__).resolve().parents[2]


def vllm_python() -> Path:
    """The python of the vLLM venv: ``$EAGLE3_VLLM_PYTHON``, else ``.vllm-venv/bin/python`` in the repository."""
    named = os.environ.get(VLLM_PYTHON_ENV)
    python = Path(named) if named else repository_root() / ".vllm-venv" / "bin" / "python"
    if not python.is_file():
        source = f"${VLLM_PYTHON_ENV}" if named else "the default venv"
        raise VllmUnavailable(f"no vLLM python at {python} ({source}); build it with {BUILD_SCRIPT}")
    return python


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class RunningVllm:
    """A started server: its OpenAI base URL (…/v1), port, process group and log."""

    base_url: str
    port: int
    served_name: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


def server_command(
    python: Path, model: str | Path, served_name: str, port: int, extra_args: Sequence[str] = ()
) -> list[str]:
    """The argv of one server (our defaults first, so ``extra_args`` can override them)."""
    return [
        str(python),
        "-m",
        SERVER_MODULE,
        "--model",
        str(model),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *DEFAULT_ARGS,
        *extra_args,
    ]


@contextmanager
def vllm_server(
    model: str | Path,
    log: Path,
    *,
    served_name: str = "target",
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[RunningVllm]:
    """A real vLLM server on a free loopback port for the ``with`` block; its process group is stopped after."""
    python = vllm_python()
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        process = subprocess.Popen(
            server_command(python, model, served_name, port, extra_args),
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **DEFAULT_ENV, **(env or {})},
            start_new_session=True,
        )
    server = RunningVllm(f"http://127.0.0.1:{port}/v1", port, served_name, process, log)
    try:
        wait_ready(server, startup_timeout_s)
        yield server
    finally:
        stop_group(process)


def wait_ready(server: RunningVllm, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise VllmStartError(f"vLLM exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise VllmStartError(f"vLLM did not answer GET /v1/models within {timeout_s:.0f} s:\n{server.log_tail()}")


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """TERM the server's process group, KILL what is left after the grace period; return once it is gone."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            process.poll()  # reap the leader, or its zombie keeps the group alive
            if not group_alive(process.pid):
                return
            time.sleep(0.1)
    process.wait()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
