"""A webhook receiver on loopback, standing in for the chat service an alert is POSTed to."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """A webhook receiver on 127.0.0.1: records every POST body and path, answers 200. Its URL ends in
    ``/hooks/<token>``, as a chat service's incoming-webhook URL carries its secret."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        received = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers["Content-Length"]))
                received.paths.append(self.path)
                received.bodies.append(json.loads(data))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/{self.token}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
