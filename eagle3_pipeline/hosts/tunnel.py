"""SSH tunnels (local port forwards, ``ssh -L``) to servers that listen on an SSH host's loopback only, and
the process's table of them.

A managed server binds 127.0.0.1 on its host, so nothing off the box reaches it. This process reaches it
through a :class:`LocalForward`: a listener on this machine's 127.0.0.1 (a free port) whose connections
each become a ``direct-tcpip`` channel over the host's paramiko connection (:meth:`SshHost.open_forward`).

Every client keeps the server's own URL (``http://gpu-box:30000/v1``: what records, reports and the
health checks name it by) and asks :func:`reach` for the URL to connect to. A route
(:meth:`Tunnels.declare`) says which SSH host and port reach a URL root; its forward opens on the first
:func:`reach` and is shared by every client of the process after that (generation, health probes,
extraction, the benchmark) — one forward per server, never one per request. :meth:`Tunnels.close` (the end
of a step or command) closes the forwards and their connections; a later :func:`reach` opens them again.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import paramiko

from eagle3_pipeline.hosts.host import HostError
from eagle3_pipeline.hosts.ssh import SshHost

__all__ = ["TUNNELS", "LocalForward", "Tunnels", "reach", "url_root"]

_CHUNK = 1 << 16
_POLL_S = 0.5
# How long opening one forwarded connection may take (the SSH connection included, when it must reconnect).
OPEN_TIMEOUT_S = 30.0


def url_root(url: str) -> str:
    """``scheme://host:port`` of a URL (the scheme's default port filled in): what a route is keyed by."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"{parts.scheme}://{f'[{host}]' if ':' in host else host}:{port}"


class LocalForward:
    """127.0.0.1:``port`` here → ``remote_host``:``remote_port`` as ``host`` sees it, until :meth:`close`."""

    def __init__(self, host: SshHost, remote_port: int, remote_host: str = "127.0.0.1") -> None:
        self.host = host
        self.remote = (remote_host, remote_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._open: set[tuple[socket.socket, paramiko.Channel]] = set()
        self._lock = threading.Lock()
        self.connections = 0  # connections forwarded so far (reuse is visible in tests and logs)
        name = f"tunnel-{host.name}-{remote_port}"
        threading.Thread(target=self._accept, name=name, daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._closed.is_set()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            threading.Thread(target=self._serve, args=(client, peer), daemon=True).start()

    def _serve(self, client: socket.socket, peer: tuple[str, int]) -> None:
        try:
            channel = self.host.open_forward(self.remote, peer, OPEN_TIMEOUT_S)
        except HostError:
            client.close()  # the client sees the connection closed, as when nothing listens
            return
        with self._lock:
            self.connections += 1
            self._open.add((client, channel))
        try:
            _pump(client, channel, self._closed)
        finally:
            with self._lock:
                self._open.discard((client, channel))
            channel.close()
            client.close()

    def close(self) -> None:
        """Stop listening and end the connections in flight."""
        self._closed.set()
        with contextlib.suppress(OSError):  # wakes the accept loop and stops listening at once (Linux)
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            pairs = list(self._open)
        for client, channel in pairs:
            channel.close()
            client.close()


def _pump(client: socket.socket, channel: paramiko.Channel, closed: threading.Event) -> None:
    """Bytes both ways until either side closes (or the forward does)."""
    while not closed.is_set():
        ready, _, _ = select.select([client, channel], [], [], _POLL_S)
        try:
            if client in ready:
                data = client.recv(_CHUNK)
                if not data:
                    return
                channel.sendall(data)
            if channel in ready:
                data = channel.recv(_CHUNK)
                if not data:
                    return
                client.sendall(data)
        except (OSError, EOFError, paramiko.SSHException):
            return


@dataclass
class _Route:
    host: SshHost
    remote_port: int
    forward: LocalForward | None = None


class Tunnels:
    """URL roots reached through a forward (module doc). Thread-safe; one per process (:data:`TUNNELS`)."""

    def __init__(self) -> None:
        self._routes: dict[str, _Route] = {}
        self._lock = threading.Lock()

    def declare(self, url: str, host: SshHost, remote_port: int) -> None:
        """Requests to ``url``'s root go through ``host`` to its 127.0.0.1:``remote_port`` (opened on first use).
        Declaring the same route again keeps its forward; another route for the root replaces it."""
        root = url_root(url)
        with self._lock:
            known = self._routes.get(root)
            if known is not None and (known.host.name, known.remote_port) == (host.name, remote_port):
                return
            if known is not None:
                _shut(known)
            self._routes[root] = _Route(host, remote_port)

    def reach(self, url: str) -> str:
        """The URL to connect to for ``url``: itself, or the same path on the forward of its root."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return url
        with self._lock:
            route = self._routes.get(url_root(url))
            if route is None:
                return url
            if route.forward is None or not route.forward.alive:
                route.forward = LocalForward(route.host, route.remote_port)
            port = route.forward.port
        return urlunsplit((parts.scheme, f"127.0.0.1:{port}", parts.path, parts.query, parts.fragment))

    def forward(self, url: str) -> LocalForward | None:
        """The open forward of ``url``'s root, if any."""
        with self._lock:
            route = self._routes.get(url_root(url))
            return route.forward if route is not None else None

    def close(self) -> None:
        """Close every forward and its SSH connection; the routes stay declared (a later reach reopens)."""
        with self._lock:
            routes = list(self._routes.values())
        for route in routes:
            _shut(route)

    def forget(self) -> None:
        """Close everything and drop the routes."""
        self.close()
        with self._lock:
            self._routes.clear()


def _shut(route: _Route) -> None:
    if route.forward is not None:
        route.forward.close()
        route.forward = None
    route.host.close()


TUNNELS = Tunnels()


def reach(url: str) -> str:
    """The URL this process connects to for ``url`` (:meth:`Tunnels.reach` of :data:`TUNNELS`)."""
    return TUNNELS.reach(url)
