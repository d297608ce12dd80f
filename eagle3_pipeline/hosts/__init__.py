"""Run a shell command somewhere: this machine (`LocalHost`) or an SSH host (`SshHost`).

Both implement `Host.run(command, timeout_s) -> CommandResult`. The command is one shell string,
so every value interpolated into it must be quoted: build commands with `quote_args(...)` (or
`shlex.quote` on each value), never with f-strings over untrusted text such as dataset ids or
paths.

`run` returns a `CommandResult` for any command that was started, including one that timed out
(`timed_out=True`, `exit_code=None`). Failures to reach the host raise a `HostError` subclass:

- `HostConnectError`: TCP/SSH handshake failed or timed out;
- `HostAuthError`: the server refused our credentials (one attempt, never retried in a loop);
- `HostKeyError`: the server's host key is unknown or changed (the connection is refused);
- `HostDisconnectedError`: the connection dropped while a command was running.

Exception texts name the host, user, key file path and fingerprints, never secrets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3_pipeline.hosts.host import (
    CommandResult,
    Host,
    HostAuthError,
    HostConnectError,
    HostDisconnectedError,
    HostError,
    HostKeyError,
    quote_args,
)
from eagle3_pipeline.hosts.local import LocalHost
from eagle3_pipeline.hosts.ssh import SshHost, host_key_fingerprint
from eagle3_pipeline.hosts.tunnel import TUNNELS, LocalForward, Tunnels, reach

if TYPE_CHECKING:
    from eagle3_pipeline.config import HostConfig

__all__ = [
    "CommandResult",
    "Host",
    "HostAuthError",
    "HostConnectError",
    "HostDisconnectedError",
    "HostError",
    "HostKeyError",
    "LocalForward",
    "LocalHost",
    "SshHost",
    "TUNNELS",
    "Tunnels",
    "build_host",
    "host_key_fingerprint",
    "quote_args",
    "reach",
]


def build_host(settings: HostConfig) -> Host:
    """The host a ``HostConfig`` section names: this machine (``kind: local``) or an SSH host."""
    if settings.kind == "local":
        return LocalHost()
    assert settings.hostname is not None
    return SshHost(settings.hostname, **settings.model_dump(exclude={"kind", "hostname"}))
