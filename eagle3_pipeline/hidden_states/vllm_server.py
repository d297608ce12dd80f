"""The vLLM extraction server as a process: the ids it was started with, read from its command line on this
machine (the ids for a store: :func:`eagle3_pipeline.target.layer_ids.extraction_layer_ids`; the flags to start it
with: :func:`eagle3_pipeline.managed.launch.extraction_args`).

The connector's file says how many layers the server captures, not which: a server started with other ids of
the same count writes files of the right shape. So the extractor proves the ids before its first request
(:meth:`eagle3_pipeline.hidden_states.vllm_capture.VllmTarget.check_layers`) from the server's own command
line: the process here that listens on ``hidden_states.vllm_base_url``'s port (the socket's inode in
``/proc/net/tcp`` / ``tcp6``, found among ``/proc/<pid>/fd``; vLLM's API server process holds it) and the
``--speculative-config`` JSON in its ``/proc/<pid>/cmdline`` (the argv as given, unlike ``ps``, which joins
it with spaces): ``draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids``. Nothing of the target is
computed, so it holds for a 1T target as for the embedded one; it needs the server on the machine where
extraction runs, which the connector's folder (read there) implies. A server in a container is seen with
host networking, by a user allowed to read its file descriptors. What cannot be read here (another host, a
process of another user, the ids given in a ``--config`` file or as dotted flags) is a refusal, never a pass.

vLLM 0.32's HTTP routes were read for the same evidence (``vllm/entrypoints``): ``/v1/models``, ``/version``
and ``/metrics`` carry no speculative config; ``/server_info`` does, only in development mode
(``VLLM_SERVER_DEV_MODE=1``, which vLLM itself warns against outside development).

A managed vLLM server (``serving.managed``, engine ``vllm``) is the extraction server when
``hidden_states.vllm_base_url`` is its URL (what the file gets when it leaves the setting out):
:func:`managed_extraction_server`. The pipeline then starts it itself for the store,
:func:`extraction_purpose`: the ids from the server's own checkpoint (its ``config.json`` read on its
host) and the store's aux layers, the connector's folder made there; the extractor's proof from the
command line above still applies.

No torch, no vLLM here: plain Python on ``/proc`` (Linux, as vLLM).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from eagle3_pipeline.config import HiddenStatesConfig, PipelineConfig
from eagle3_pipeline.health import server_root
from eagle3_pipeline.hidden_states.store import default_aux_layer_ids
from eagle3_pipeline.hosts import Host, quote_args
from eagle3_pipeline.managed import LaunchError, ServerPurpose, ServerSetup, managed_servers
from eagle3_pipeline.target.folder import TargetError, dimensions
from eagle3_pipeline.target.layer_ids import extraction_layer_ids, target_family

HOST_COMMAND_TIMEOUT_S = 60.0

SPECULATIVE_FLAGS = ("--speculative-config", "-sc")
LISTEN = "0A"  # the TCP state column of /proc/net/tcp for a listening socket


@dataclass(frozen=True)
class Listeners:
    """The processes here holding a listening TCP socket on a port; ``hidden``: sockets whose owner this
    user cannot see."""

    pids: list[int]
    sockets: int
    hidden: int


def listeners(port: int) -> Listeners:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            columns = line.split()
            if len(columns) > 9 and columns[3] == LISTEN and int(columns[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{columns[9]}]")
    pids, seen = set(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        links = set()
        for fd in fds:
            try:
                links.add(os.readlink(fd))
            except OSError:  # closed meanwhile (the listing's own descriptor, for this process)
                continue
        if links & inodes:
            pids.add(int(entry.name))
            seen |= links & inodes
    return Listeners(sorted(pids), len(inodes), len(inodes - seen))


def command_line(pid: int) -> list[str]:
    """The process's argv as it was given ([] when it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="surrogateescape") for part in raw.split(b"\0")[:-1]]


def layer_ids_in(argv: Sequence[str]) -> list[int] | str:
    """``eagle_aux_hidden_state_layer_ids`` of the last ``--speculative-config`` JSON in ``argv``, or why
    they cannot be read from it."""
    value = None
    for index, arg in enumerate(argv):
        flag, equals, rest = arg.partition("=")
        flag = flag.replace("_", "-") if flag.startswith("--") else flag
        if flag in SPECULATIVE_FLAGS:
            value = rest if equals else (argv[index + 1] if index + 1 < len(argv) else "")
        elif flag.startswith(tuple(f"{f}." for f in SPECULATIVE_FLAGS)):
            return f"it gives the speculative config as dotted flags ({flag}), not as one JSON value"
        elif len(flag) > 2 and SPECULATIVE_FLAGS[0].startswith(flag):
            return f"it abbreviates --speculative-config as {flag}"
    if value is None:
        return "no --speculative-config on its command line"
    try:
        ids = json.loads(value)["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    except (ValueError, KeyError, TypeError):
        return "its --speculative-config is not JSON with draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids"
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return f"its eagle_aux_hidden_state_layer_ids {ids!r} are not a list of integers"
    return ids


def is_this_machine(host: str) -> bool:
    """Whether ``host`` names an address of this machine (one a socket can bind to here)."""
    try:
        addresses = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in addresses:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:
                continue
            return True
    return False


def extraction_url(base_url: str) -> str:
    """``base_url`` as the extractor reaches it: a server on this machine at 127.0.0.1 (a managed server binds
    loopback, so its host's own name does not reach it), any other as it is."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    if host in ("127.0.0.1", "localhost", "::1") or not is_this_machine(host):
        return base_url
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit((parts.scheme, f"127.0.0.1{port}", parts.path, parts.query, parts.fragment))


def served_layer_ids(host: str, port: int) -> tuple[list[int], int] | str:
    """The ids the server at ``host:port`` was started with and the pid whose command line says so,
    or why they cannot be read here."""
    if not is_this_machine(host):
        return f"{host!r} is not this machine, so the server's command line cannot be read here"
    found = listeners(port)
    if not found.sockets:
        return f"nothing listens on port {port} here"
    if found.hidden or not found.pids:
        return f"the process listening on port {port} is not visible to this user ({os.getuid()})"
    readings = {pid: layer_ids_in(command_line(pid)) for pid in found.pids}
    started = {json.dumps(ids): (ids, pid) for pid, ids in readings.items() if isinstance(ids, list)}
    if len(started) == 1:
        return next(iter(started.values()))
    if started:
        return f"the processes listening on port {port} were started with different ids ({list(started)})"
    pid = found.pids[0]
    return f"pid {pid} listening on port {port}: {readings[pid]}"  # not the whole command line: it may hold a key


class ExtractionServerError(LaunchError):
    """The managed extraction server's launch cannot be built: the message names the file and setting."""


def managed_extraction_server(config: PipelineConfig) -> ServerSetup | None:
    """The managed vLLM server that serves ``hidden_states.vllm_base_url`` (backend vllm), or None: the
    extraction server is then the user's."""
    settings = config.hidden_states
    if settings.backend != "vllm" or settings.vllm_base_url is None:
        return None
    url = server_root(settings.vllm_base_url)
    return next((p for p in managed_servers(config) if p.engine == "vllm" and server_root(p.base_url) == url), None)


def extraction_purpose(
    hidden_states: HiddenStatesConfig, source_file: Path, setup: ServerSetup, host: Host
) -> ServerPurpose:
    """The managed server started for the store: ``extract_hidden_states`` with the ids of the store's aux
    layers (``hidden_states.aux_layer_ids``, else the default for the server's checkpoint) and of its last
    layer, read from ``serving.model``'s ``config.json`` on ``host``; the connector's folder
    (``hidden_states.vllm_output_dir``) is made there."""
    assert setup.serving.model is not None and hidden_states.vllm_output_dir is not None
    path = f"{setup.serving.model.rstrip('/')}/config.json"
    where = f"{setup.setting}.model: {path} on {host.name}"
    read = host.run(quote_args("cat", path), HOST_COMMAND_TIMEOUT_S)
    if not read.ok:
        raise ExtractionServerError(
            f"{source_file}: {where}: not readable ({read.stderr.strip()[:200] or 'no output'}); the "
            "extraction server's layer ids come from the target's config.json in the checkpoint folder it serves"
        )
    try:
        raw = json.loads(read.stdout)
        layers = dimensions(raw, where).num_layers
    except (ValueError, TargetError) as exc:
        raise ExtractionServerError(f"{source_file}: {where}: {exc}") from None
    output_ids = hidden_states.aux_layer_ids or default_aux_layer_ids(layers)
    ids = extraction_layer_ids(target_family(raw), output_ids, layers)
    folder = hidden_states.vllm_output_dir
    made = host.run(quote_args("mkdir", "-p", folder), HOST_COMMAND_TIMEOUT_S)
    if not made.ok:
        raise ExtractionServerError(
            f"{source_file}: hidden_states.vllm_output_dir: cannot make {folder} on {host.name} "
            f"({made.stderr.strip()[:200]})"
        )
    return ServerPurpose.extraction_of(ids, folder)
