"""The embedded profile's inference server: ``transformers serve`` for the local model folder
(:mod:`eagle3_pipeline.target.local_model`) on a free localhost port, a child process each run starts
itself and stops. ``python -m eagle3_pipeline.inference.embedded`` is the child's entry point.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from eagle3_pipeline.target.local_model import ModelNotAvailable, is_prepared

STOP_GRACE_S = 15.0


class ServerStartError(RuntimeError):
    """The embedded server exited or did not answer a real completion in time."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def probe_completion(base_url: str, model: str, timeout_s: float, api_key: str | None = None) -> dict[str, Any]:
    """One real 1-token chat completion; raises on any failure."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.post(
        base_url.rstrip("/") + "/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 1},
        headers=headers,
        timeout=timeout_s,
    )
    reply.raise_for_status()
    payload = reply.json()
    payload["choices"][0]["message"]
    return payload


class EmbeddedServer:
    """``transformers serve`` for a local model folder, as a child process in its own session.

    The child resets SIGINT/SIGTERM to their defaults (a parent that ignores them must not make the
    server unkillable) and exits by itself if its parent dies, so a killed pipeline leaves no orphan.
    """

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        port: int = 0,
        startup_timeout_s: float = 600.0,
        continuous_batching: bool = True,
        cb_num_blocks: int = 512,
        cb_block_size: int = 32,
    ) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.continuous_batching = continuous_batching
        self.cb_num_blocks = cb_num_blocks
        self.cb_block_size = cb_block_size
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def model(self) -> str:
        return str(self.model_dir)

    def command(self) -> list[str]:
        args = ["serve", str(self.model_dir), "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.continuous_batching:
            args += [
                "--continuous-batching",
                "--cb-num-blocks",
                str(self.cb_num_blocks),
                "--cb-block-size",
                str(self.cb_block_size),
            ]
        else:
            args.append("--no-continuous-batching")
        return [sys.executable, "-m", "eagle3_pipeline.inference.embedded", json.dumps(args)]

    def start(self) -> str:
        if not is_prepared(self.model_dir):
            raise ModelNotAvailable(f"{self.model_dir} holds no prepared model; materialize `target_model` first")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"transformers serve exited with code {self.process.returncode}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                probe_completion(self.base_url, self.model, timeout_s=60)
                return self.base_url
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                time.sleep(1.0)
        self.stop()
        raise ServerStartError(
            f"transformers serve did not answer a 1-token completion within {self.startup_timeout_s:g} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_GRACE_S)
    os._exit(1)


def _serve_main(argv: list[str]) -> None:
    """Child entry point: default signal handling, parent watch, then `transformers serve`."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    from transformers.cli.transformers import main

    sys.argv = ["transformers", *json.loads(argv[0])]
    main()


if __name__ == "__main__":
    _serve_main(sys.argv[1:])
