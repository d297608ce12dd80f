"""SSH tunnels over the loopback sshd (a real OpenSSH server): a server that listens on the "remote" host's
127.0.0.1 only is reached here through one forward per server, shared by every client of the process; a
name that resolves nowhere (``gpu-box.test``) proves that the connection went through the tunnel."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from eagle3_pipeline.hosts import LocalHost, Tunnels
from eagle3_pipeline.testing.process_tools import free_port
from eagle3_pipeline.testing.sshd_fixture import Sshd


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = f"{self.path} {self.client_address[0]}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def loopback_server() -> Iterator[int]:
    """A tiny HTTP server on 127.0.0.1 only (the "remote" host's loopback: the sshd runs on this machine)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_loopback_server_is_reached_through_one_shared_forward(sshd: Sshd, loopback_server: int) -> None:
    tunnels = Tunnels()
    url = f"http://gpu-box.test:{loopback_server}/v1"
    tunnels.declare(url, sshd.host(), loopback_server)
    try:
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/models", timeout=5)  # the name resolves nowhere: only the tunnel gets there
        reached = tunnels.reach(url + "/models")
        assert reached.startswith("http://127.0.0.1:") and reached.endswith("/v1/models")
        with httpx.Client(timeout=10) as one, httpx.Client(timeout=10) as other:
            answers = [
                client.get(tunnels.reach(url + f"/models?n={i}")).text for i in range(3) for client in (one, other)
            ]
        assert answers[0] == "/v1/models?n=0 127.0.0.1", "the server saw a connection from its own loopback (sshd)"
        forward = tunnels.forward(url)
        assert forward is not None and {tunnels.reach(url)} == {f"http://127.0.0.1:{forward.port}/v1"}
        assert forward.connections == 2, "two clients, two connections kept alive, one forward"
        assert tunnels.reach("http://other.test:1/v1") == "http://other.test:1/v1", "undeclared: unchanged"
    finally:
        tunnels.close()
    assert forward is not None and not forward.alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{forward.port}/v1/models", timeout=5)
    try:
        assert httpx.get(tunnels.reach(url + "/models"), timeout=10).status_code == 200, "reopened on next use"
    finally:
        tunnels.forget()


def test_nothing_listening_behind_the_tunnel_closes_the_connection(sshd: Sshd) -> None:
    tunnels = Tunnels()
    url = f"http://gpu-box.test:{free_port()}"
    tunnels.declare(url, sshd.host(), int(url.rsplit(":", 1)[1]))
    try:
        with pytest.raises(httpx.TransportError):
            httpx.get(tunnels.reach(url + "/health"), timeout=10)
    finally:
        tunnels.forget()


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_a_command_reads_its_stdin_which_no_command_line_shows(where: str, sshd: Sshd) -> None:
    host = LocalHost() if where == "local" else sshd.host()
    try:
        result = host.run("cat; tr '\\0' ' ' </proc/$$/cmdline", 10, stdin=b"s3cret-value\n")
        assert result.ok and result.stdout.startswith("s3cret-value\n")
        assert result.stdout.count("s3cret-value") == 1, result.stdout
        assert host.run("cat", 10).stdout == "", "no stdin: an empty input, not a wait"
    finally:
        host.close()
