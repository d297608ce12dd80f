"""A real OpenAI-compatible HTTP server on loopback whose answers a test scripts.

It stands in for the inference server where a test needs a behaviour the tiny real model cannot
produce on demand (slowness, errors). It answers `/v1/chat/completions` with a deterministic echo.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Script = Callable[[dict[str, Any], int], tuple[int, dict[str, Any] | None]]


def echo_completion(body: dict[str, Any], completion_tokens: int = 5) -> dict[str, Any]:
    last = body["messages"][-1]["content"]
    return {
        "id": "cmpl-test",
        "object": "chat.completion",
        "model": body.get("model", "fake"),
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": f"echo: {last[:40]}"}}],
        "usage": {"prompt_tokens": 11, "completion_tokens": completion_tokens, "total_tokens": 11 + completion_tokens},
    }


@dataclass
class FakeOpenAI:
    delay_s: float = 0.0
    script: Script | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def start(self) -> FakeOpenAI:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: dict[str, Any] | None) -> None:
                data = json.dumps(payload or {"error": {"message": "scripted failure"}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                with fake._lock:
                    fake.requests.append(body)
                    fake.headers_seen.append(dict(self.headers))
                    number = len(fake.requests)
                if fake.delay_s:
                    time.sleep(fake.delay_s)
                if fake.script is not None:
                    status, payload = fake.script(body, number)
                else:
                    status, payload = 200, echo_completion(body)
                self._send(status, payload)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
