"""Where each arm of the benchmark is served: a server started from ``launch_command`` on the host (its own
session, its log in a private folder, stopped by process group) or the managed server's launch lines.

``launch_command``'s placeholders take the arm's configuration: ``{steps}``, ``{topk}``, ``{draft_tokens}``,
``{speculative_config}`` (vLLM's JSON) and ``{speculative}`` (empty for the baseline, ``speculative_args`` or
the server's own flags, :func:`eagle3_pipeline.managed.launch.drafter_args`, for a configuration); every value
is ``shlex.quote``d. The default lines bind the host's 127.0.0.1, reached through the SSH tunnel
(:mod:`eagle3_pipeline.hosts.tunnel`).
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any, Protocol

import httpx

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.config import DrafterBenchmarkConfig
from eagle3_pipeline.drafter.serve.client import BenchmarkError, Client
from eagle3_pipeline.drafter.serve.sweep import SpeculativeConfig
from eagle3_pipeline.health import ServerSpec
from eagle3_pipeline.hosts import Host, quote_args
from eagle3_pipeline.hosts.identity import RECORD_IDENTITY, ProcessIdentity, kill_recorded_group
from eagle3_pipeline.hosts.private import PrivateStateError, ensure_private_dir
from eagle3_pipeline.managed import Supervisor
from eagle3_pipeline.managed.launch import (
    EngineSettings,
    ServerPurpose,
    build_launch,
    drafter_args,
    vllm_eagle3_config,
)

POLL_S = 2.0
STOP_GRACE_S = 30
HOST_COMMAND_TIMEOUT_S = 60.0


def benchmark_path(settings: DrafterBenchmarkConfig, name: str) -> str:
    """``target_model_path``, ``draft_model_path`` or ``log_dir``, which the benchmark's settings fill in."""
    value = getattr(settings, name)
    if not isinstance(value, str):
        raise BenchmarkError(f"drafter_benchmark.{name}: not set (benchmark_settings fills it in from the pipeline)")
    return value


def launch_command(settings: DrafterBenchmarkConfig, config: SpeculativeConfig | None) -> str:
    """The shell command line of the baseline (``config`` None) or of one speculative configuration, every
    value quoted: the user's templates when set, else the servers' builder
    (:func:`eagle3_pipeline.managed.launch.build_launch`)."""
    target = benchmark_path(settings, "target_model_path")
    drafter = (config or SpeculativeConfig(settings.steps)).drafter(benchmark_path(settings, "draft_model_path"))
    values: dict[str, Any] = {
        "target": shlex.quote(target),
        "drafter": shlex.quote(drafter.path),
        "port": settings.port,
        "tp": settings.tp_size,
        "steps": drafter.steps,
        "topk": drafter.topk,
        "draft_tokens": drafter.verified,
        "speculative_config": shlex.quote(json.dumps(vllm_eagle3_config(drafter))),
    }
    if config is None:
        extra = ""
    elif settings.speculative_args:
        extra = settings.speculative_args.format(**values)
    else:
        extra = shlex.join(drafter_args(settings.server, drafter))
    if settings.launch_command:
        return settings.launch_command.format(**values, speculative=extra).strip()
    # Loopback: the benchmark reaches a server on an SSH host through a tunnel (eagle3_pipeline.hosts.tunnel).
    server = EngineSettings(settings.server, "python", target, settings.port, "127.0.0.1", settings.tp_size)
    return f"{build_launch(server, ServerPurpose.benchmark(None)).shell()} {extra}".strip()


def server_spec(settings: DrafterBenchmarkConfig, base_url: str) -> ServerSpec:
    """What the health gate checks once the server is up. A ``process_pattern`` makes an SGLang server a
    custom one (no per-rank scheduler check); a vLLM server stays ``vllm`` (it has no per-rank check, and
    keeps its ``/metrics`` for the throughput check)."""
    custom = settings.process_pattern and settings.server == "sglang"
    return ServerSpec(
        kind="custom" if custom else settings.server,
        port=settings.port,
        base_url=base_url.rstrip("/"),
        model=benchmark_path(settings, "target_model_path"),
        tp_size=settings.tp_size,
        process_pattern=settings.process_pattern,
    )


class RemoteServer:
    """One server process group on the host, started in its own session, its log in a private folder
    (:mod:`eagle3_pipeline.hosts.private`), and stopped by group only while its leader is the process started
    (pid, start time, boot id: :func:`eagle3_pipeline.hosts.identity.kill_recorded_group`)."""

    def __init__(self, host: Host, command: str, log_path: str) -> None:
        self.host = host
        self.command = command
        self.log_path = log_path
        self.identity: ProcessIdentity | None = None

    @property
    def pid(self) -> int | None:
        return self.identity.pid if self.identity is not None else None

    def start(self) -> None:
        try:
            ensure_private_dir(self.host, str(Path(self.log_path).parent), "drafter_benchmark.log_dir")
        except PrivateStateError as exc:
            raise BenchmarkError(str(exc)) from None
        log = shlex.quote(self.log_path)
        line = (
            f"if [ -L {log} ]; then echo 'the log is a symbolic link: refused' >&2; exit 1; fi; "
            f"setsid sh -c {shlex.quote(self.command)} > {log} 2>&1 < /dev/null & p=$!; {RECORD_IDENTITY}"
        )
        result = self.host.run(line, HOST_COMMAND_TIMEOUT_S)
        identity = ProcessIdentity.parse(result.stdout.strip()) if result.ok else None
        if identity is None:
            raise BenchmarkError(
                f"{self.host.name}: could not start the server ({result.stderr.strip() or result.stdout.strip()})"
            )
        self.identity = identity

    def alive(self) -> bool:
        return (
            self.pid is not None and self.host.run(quote_args("pgrep", "-g", str(self.pid)), HOST_COMMAND_TIMEOUT_S).ok
        )

    def log_tail(self, lines: int = 20) -> str:
        return self.host.run(quote_args("tail", "-n", str(lines), self.log_path), HOST_COMMAND_TIMEOUT_S).stdout

    def stop(self) -> None:
        if self.identity is None:
            return
        # Refused only when its pid is another process's or the host rebooted: the server is gone either way.
        kill_recorded_group(self.host, self.identity, STOP_GRACE_S)
        self.identity = None


def wait_ready(server: RemoteServer, client: Client, timeout_s: float) -> None:
    """Until the server answers a 1-token request; :class:`BenchmarkError` with its log if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive():
            raise BenchmarkError(f"the server exited during start-up; log {server.log_path}:\n{server.log_tail()}")
        try:
            client.complete([1], 1)
            return
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            time.sleep(POLL_S)
    raise BenchmarkError(
        f"the server did not answer within {timeout_s:g} s; log {server.log_path}:\n{server.log_tail()}"
    )


def arm_name(config: SpeculativeConfig | None) -> str:
    """``baseline``, or the configuration's name in logs and files (``speculative-K3-top1-4``)."""
    return "baseline" if config is None else f"speculative-K{config.steps}-top{config.topk}-{config.verified}"


class ArmServers(Protocol):
    """How the benchmark gets the server of each arm (``None``: the baseline): :meth:`start` returns once it
    answers, with what the health gate checks on it; :meth:`stop` after the arm."""

    def start(self, config: SpeculativeConfig | None) -> ServerSpec: ...

    def stop(self) -> None: ...


class CommandServers:
    """Each arm's server from ``launch_command`` (:func:`launch_command`), stopped after its arm."""

    def __init__(self, settings: DrafterBenchmarkConfig, host: Host, base_url: str, report: Reporter) -> None:
        self.settings = settings
        self.host = host
        self.base_url = base_url
        self.report = report
        self.server: RemoteServer | None = None

    def start(self, config: SpeculativeConfig | None) -> ServerSpec:
        settings = self.settings
        name = arm_name(config)
        self.server = RemoteServer(
            self.host, launch_command(settings, config), f"{benchmark_path(settings, 'log_dir')}/{name}.log"
        )
        self.report.log(f"{name}: starting `{self.server.command}` on {self.host.name}")
        self.server.start()
        client = Client(settings.server, self.base_url, settings.request_timeout_s)
        try:
            wait_ready(self.server, client, settings.startup_timeout_s)
        finally:
            client.close()
        return server_spec(settings, self.base_url)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class ManagedServers:
    """Each arm's server from the managed server's launch lines (``ServerPurpose.benchmark``): the supervisor
    replaces the previous arm's server with it, and is left to stop the last one."""

    def __init__(self, supervisor: Supervisor, drafter: str) -> None:
        self.supervisor = supervisor
        self.drafter = drafter

    def start(self, config: SpeculativeConfig | None) -> ServerSpec:
        purpose = ServerPurpose.benchmark(config.drafter(self.drafter) if config is not None else None)
        self.supervisor.ensure(purpose, f"drafter_benchmark: the {arm_name(config)} arm")
        return self.supervisor.server.setup.server_spec()

    def stop(self) -> None:
        return None
