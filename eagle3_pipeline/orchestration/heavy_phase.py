"""Run a heavy phase where ``compute:`` says, from inside an asset: ``run_heavy_phase``.

- ``local``: the phase function in this process, with a reporter that logs to the run and records
  each progress point as an asset observation; a phase run in several processes (``processes`` >
  1: training under torchrun) or with another python (``python``: SGLang's venv) starts the worker
  as a local Dagster Pipes subprocess instead, the same command line as on the GPU host
  (:func:`eagle3_pipeline.compute.worker_argv`).
- ``ssh``: ``python -m eagle3_pipeline.worker PHASE --spec FILE`` on the GPU host as a Dagster
  Pipes process. The Pipes context travels in environment variables set on the remote command
  line (:class:`dagster.PipesEnvContextInjector`); the worker appends its Pipes messages to a file
  in its run folder, which :class:`PipesRemoteFileMessageReader` follows over SSH, so its logs,
  progress and materialization metadata arrive in the run as from a local subprocess. An
  interrupted or terminated step kills the remote process group before it re-raises.
- ``command``: for the ``extract`` phase only, the configured user command (e.g. SpecForge's
  ``prepare_hidden_states.py``) runs on the host the same way (its output lines stream into the
  run's log; ``{spec}`` is the extract spec, host paths), then the worker's ``import-specforge``
  phase turns its output folder into our store there, building the store's identity from that
  extract spec on the host (:func:`eagle3_pipeline.hidden_states.importer.spec_from_extract`).
  The output folder, ``<artifacts_root>/specforge/<training data version>``, is emptied before the
  command runs and deleted once the import succeeded (a SpecForge output is TB for a 1T target).
  Every other phase (``train``, ``evaluate``) runs our worker on that host as for ``ssh``.

Outputs stay on the host under ``compute.artifacts_root``; only the ``fetch`` paths come back.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import dagster as dg
from dagster_pipes import PIPES_PROTOCOL_VERSION_FIELD

from eagle3_pipeline.compute import local_gpu_count, resolve_processes, run_local, worker_argv
from eagle3_pipeline.compute.remote import COMMAND, MESSAGES, SPEC, WORKER, Fate, RemoteError, RemoteRun
from eagle3_pipeline.config import ComputeConfig
from eagle3_pipeline.hosts import HostError, SshHost, build_host
from eagle3_pipeline.worker import PROGRESS_MESSAGE


@contextmanager
def quiet_pipes() -> Iterator[None]:
    """A Pipes session without Dagster's PreviewWarning about its own use of
    `PipesMessageReader.expected_writer_count` (Dagster 1.13 reads that preview property inside every
    session; nothing of this project calls it), so a normal run prints no warning. Other warnings pass."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*expected_writer_count", category=dg.PreviewWarning)
        yield


IMPORT_PHASE = "import-specforge"
COMMAND_PHASE = "extract"  # the one phase compute.command replaces
Interpreter = tuple[str, str]  # (the python a worker runs with, the setting that names it)


def _observe(context: dg.AssetExecutionContext, metrics: Mapping[str, Any]) -> None:
    partition = context.partition_key if context.has_partition_key else None
    context.log_event(dg.AssetObservation(asset_key=context.asset_key, partition=partition, metadata=dict(metrics)))


class DagsterReporter:
    """A phase running in this process reports to the run: log lines, and progress as a log line
    plus an asset observation (the UI plots observations)."""

    def __init__(self, context: dg.AssetExecutionContext) -> None:
        self._context = context

    def log(self, message: str) -> None:
        self._context.log.info(message)

    def progress(self, metrics: Mapping[str, float | int | str]) -> None:
        self._context.log.info("progress: " + ", ".join(f"{k}={v}" for k, v in metrics.items()))
        _observe(self._context, metrics)


class PipesRemoteFileMessageReader(dg.PipesMessageReader):
    """Pipes messages that the remote worker appends to ``path`` on the host (the params it gets
    are ``{"path": path}``); the caller follows that file over SSH and hands each line to
    :meth:`handle_line`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._handler: dg.PipesMessageHandler | None = None

    @contextmanager
    def read_messages(self, handler: dg.PipesMessageHandler) -> Iterator[dict[str, Any]]:
        self._handler = handler
        try:
            yield {"path": self.path}
        finally:
            self._handler = None

    def handle_line(self, line: str) -> dict[str, Any] | None:
        """Pass one line to the session; returns the message, or None for a non-message line."""
        if self._handler is None:
            raise RuntimeError("PipesRemoteFileMessageReader used outside its Pipes session")
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            return None
        if not isinstance(message, dict) or PIPES_PROTOCOL_VERSION_FIELD not in message:
            return None
        self._handler.handle_message(message)  # type: ignore[arg-type]
        return message

    def no_messages_debug_text(self) -> str:
        return f"Attempted to read messages by following {self.path} on the remote host over SSH."


def under_root(path: str, root: Path) -> bool:
    """``path`` is a local path inside the artifacts root ``root``, so it can be shipped (a path
    elsewhere, or a Hugging Face id, is used as written on the host)."""
    return Path(path).is_absolute() and Path(path).resolve().is_relative_to(root.resolve())


def _metadata_values(result: dg.MaterializeResult) -> dict[str, Any]:
    return {
        key: value.value if isinstance(value, dg.MetadataValue) else value
        for key, value in (result.metadata or {}).items()
    }


def _guarded(
    context: dg.AssetExecutionContext,
    remote: RemoteRun,
    name: str,
    command: str,
    follow: str,
    on_line: Callable[[str], None],
) -> Fate:
    """Run a remote process to its end; if the step is interrupted (run terminated), kill it."""
    try:
        return remote.start(name, command, follow, on_line)
    except BaseException:
        try:
            fate = remote.kill(name)
        except HostError as exc:
            context.log.error(
                f"step stopped: cannot reach {remote.host.name} to kill the remote {name} of {remote.run_dir} "
                f"({exc}); its pid is in {name}.pid there"
            )
        else:
            context.log.warning(
                f"step stopped: killed the remote {name} of {remote.run_dir} on {remote.host.name}; "
                f"it is {fate.describe()}"
            )
        raise


def _output_name(spec: Mapping[str, Any]) -> str:
    """The command's output folder: named by the training data's version, so that a retry rewrites the same
    folder (emptied first) instead of writing a whole SpecForge output beside the last."""
    from eagle3_pipeline.training_data.reader import TrainingData

    version = TrainingData.open(Path(spec["training_data"])).version()
    return re.sub(r"[^A-Za-z0-9._-]+", "-", version).strip(".-")[:80] or "training-data"


def _require_success(remote: RemoteRun, name: str, fate: Fate) -> None:
    if fate.exit_code != 0:
        raise RemoteError(
            f"the remote {name} on {remote.host.name} {fate.describe()}; "
            f"last lines of {remote.run_dir}/{name}.log:\n{remote.log_tail(name)}"
        )


def _session_metadata(session: Any, where: str) -> dict[str, Any]:
    results = [r for r in session.get_results() if isinstance(r, dg.MaterializeResult)]
    if not results:
        raise RemoteError(f"the worker {where} exited 0 but reported no materialization")
    return _metadata_values(results[-1])


def _run_local_workers(
    context: dg.AssetExecutionContext, phase: str, spec: dict[str, Any], processes: int, python: Interpreter
) -> dict[str, Any]:
    """The worker in ``processes`` local processes (torchrun) as a Pipes subprocess; rank 0's logs
    stream into the run, its progress points become observations when it ends. An interrupted step
    kills the launch's process group."""
    with tempfile.TemporaryDirectory(prefix=f"eagle3-{phase}-") as folder:
        spec_file = Path(folder) / SPEC
        spec_file.write_text(json.dumps(spec, indent=2))
        argv = worker_argv(phase, str(spec_file), python[0], processes)
        context.log.info(
            f"running {phase} in {processes} local process{'es' if processes > 1 else ''}: {shlex.join(argv)}"
        )
        with (
            quiet_pipes(),
            dg.open_pipes_session(
                context=context,
                context_injector=dg.PipesEnvContextInjector(),
                message_reader=dg.PipesTempFileMessageReader(),
            ) as session,
        ):
            try:
                process = subprocess.Popen(
                    argv, env={**os.environ, **session.get_bootstrap_env_vars()}, start_new_session=True
                )
            except OSError as exc:
                raise RemoteError(
                    f"{python[1]}: cannot start {python[0]!r} ({exc}); "
                    "expected the python of the venv to run the phase with"
                ) from None
            try:
                code = process.wait()
            except BaseException:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                context.log.warning(f"step stopped: killed the local {phase} launch (process group {process.pid})")
                raise
        for message in session.get_custom_messages():
            if isinstance(message, dict) and message.get("type") == PROGRESS_MESSAGE:
                _observe(context, message.get("metrics") or {})
    if code != 0:
        raise RemoteError(
            f"the local {phase} launch of {processes} processes exited with status {code}; "
            "its ranks' errors are in the run's stderr"
        )
    return _session_metadata(session, "launched here")


def _run_worker(
    context: dg.AssetExecutionContext, remote: RemoteRun, phase: str, python: str, processes: int
) -> dict[str, Any]:
    reader = PipesRemoteFileMessageReader(str(remote.run_dir / MESSAGES))

    def on_line(line: str) -> None:
        message = reader.handle_line(line)
        if message is not None and message.get("method") == "report_custom_message":
            payload = (message.get("params") or {}).get("payload")
            if isinstance(payload, dict) and payload.get("type") == PROGRESS_MESSAGE:
                _observe(context, payload.get("metrics") or {})

    with (
        quiet_pipes(),
        dg.open_pipes_session(
            context=context, context_injector=dg.PipesEnvContextInjector(), message_reader=reader
        ) as session,
    ):
        command = remote.worker_command(phase, python, session.get_bootstrap_env_vars(), processes)
        if processes > 1:
            context.log.info(f"running {phase} on {remote.host.name} in {processes} processes (torchrun)")
        fate = _guarded(context, remote, WORKER, command, MESSAGES, on_line)
    _require_success(remote, WORKER, fate)
    return _session_metadata(session, f"on {remote.host.name}")


def run_heavy_phase(
    context: dg.AssetExecutionContext,
    compute: ComputeConfig,
    *,
    artifacts_root: Path,
    phase: str,
    spec: dict[str, Any],
    ship: Sequence[str] = (),
    fetch: Sequence[str] = (),
    processes: int | Literal["auto"] = 1,
    python: Interpreter | None = None,
    gpus: tuple[int, str] | None = None,
) -> dict[str, Any]:
    """Run ``phase`` with ``spec`` (local paths) where ``compute`` says; returns its metadata.

    ``ship``: local files or folders under the artifacts root to copy to the host first;
    ``fetch``: paths relative to the artifacts root to copy back afterwards (the index and the
    manifest — outputs stay on the host). Both are ignored for ``local``. ``processes``: how many
    worker processes (torchrun ranks) run the phase; ``auto`` one per GPU of the machine it runs on.
    ``python``: ``(interpreter, the setting naming it)`` when the worker runs with another python
    than ``compute.python`` (remotely) or this process's (locally: then always as a subprocess), e.g.
    SGLang's venv; ``gpus``: ``(count, setting)`` when the phase needs more free GPUs on the host
    than ``compute.gpus``.
    """
    if compute.kind == "local":
        count = resolve_processes(processes, local_gpu_count() if processes == "auto" else 0)
        if count > 1 or python is not None:
            return {
                **_run_local_workers(context, phase, spec, count, python or (sys.executable, "this process")),
                "compute": "local",
            }
        return {**run_local(phase, spec, DagsterReporter(context)), "compute": "local"}
    host = build_host(compute.host)
    if not isinstance(host, SshHost):
        raise RemoteError(f"compute.kind {compute.kind!r} needs an SSH host")
    need, need_setting = gpus if gpus is not None and gpus[0] > compute.gpus else (compute.gpus, "compute.gpus")
    with host:
        remote = RemoteRun(host, compute, artifacts_root, context.run.run_id, phase, warn=context.log.warning)
        context.log.info(f"GPU check: {remote.check_gpus(need, need_setting)}")
        if python is not None:
            remote.check_python(*python)
        remote.prepare()
        shipped = remote.ship(ship)
        context.log.info(
            f"shipped {shipped['shipped_files']} file(s), {shipped['shipped_bytes']} bytes to {host.name} "
            f"({shipped['already_there']} already there)"
        )
        remote_spec = remote.translate(spec)
        extra: dict[str, Any] = {}
        if compute.kind == "command" and phase == COMMAND_PHASE:
            assert compute.command is not None
            output_dir = str(remote.remote_root / "specforge" / _output_name(spec))
            remote.write_spec(remote_spec)
            user = remote.user_command(compute.command, output_dir)
            context.log.info(
                f"running compute.command on {host.name}, writing to {output_dir}"
            )  # not its text: it may hold a token
            fate = _guarded(
                context,
                remote,
                COMMAND,
                f"rm -rf {shlex.quote(output_dir)} && mkdir -p {shlex.quote(output_dir)} && {user}",
                f"{COMMAND}.log",
                lambda line: context.log.info(f"[command] {line}"),
            )
            _require_success(remote, COMMAND, fate)
            remote_spec = {"extract": remote_spec, "input_dir": output_dir}
            phase = IMPORT_PHASE
            extra["command_output"] = output_dir
        remote.write_spec(remote_spec)
        count = resolve_processes(processes, remote.gpu_count() if processes == "auto" else 0)
        metadata = _run_worker(context, remote, phase, python[0] if python is not None else compute.python, count)
        if "command_output" in extra:
            remote.remove(extra["command_output"])
            context.log.info(f"imported, so deleted the command's output {extra['command_output']} on {host.name}")
        fetched = remote.fetch(fetch)
    return {
        **metadata,
        **extra,
        "compute": compute.kind,
        "host": host.name,
        "remote_artifacts_root": str(remote.remote_root),
        "remote_run_dir": str(remote.run_dir),
        "fetched": [str(path) for path in fetched],
        **shipped,
    }
