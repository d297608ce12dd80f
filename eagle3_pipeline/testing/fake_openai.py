"""A real OpenAI-compatible HTTP server on loopback whose answers a test scripts.

It stands in for the inference server where a test needs a behaviour the tiny real model cannot
produce on demand. By default it answers `/v1/chat/completions` with a deterministic echo; a
``script`` can instead answer any request with a :class:`Reply`: another status (429 with
``Retry-After``, bursts of 500), a hang, a slow answer, a truncated JSON body, a connection reset,
or a completion cut by ``max_tokens`` (``echo_completion(body, finish_reason="length")``).
``token_delay_s`` × ``completion_tokens`` sets how fast the default echo is "generated".
``POST /tokenize`` (at the root, as SGLang and vLLM serve it) answers ``{"tokens", "count",
"max_model_len"}`` from ``tokenize`` (a ``text -> ids`` callable, e.g. a real tokenizer's encode),
or 404 like a server without the route when none is set; those requests are kept apart in
``tokenize_requests``. ``GET /v1/models`` reports ``max_model_len`` when it is set (as vLLM and SGLang
do; a hosted API does not), and ``GET /server_info`` (and ``/get_server_info``) answers ``server_info``
(SGLang's server args, e.g. ``{"tool_call_parser": None, "reasoning_parser": None}``), or 404 like
any server but SGLang when it is not set. The pipeline's capability probes (chat requests whose last
user turn starts with :data:`~eagle3_pipeline.generation.capabilities.PROBE_PREFIX`) are kept apart in
``probe_requests``: a ``script`` answers them too, numbered 0, and ``requests`` and the numbering hold
only the partition's own requests.

As a separate process (the benchmark and the kill tests):
``python -m eagle3_pipeline.testing.fake_openai [--port N] [--delay-s S]`` prints its base URL on the
first line of stdout and serves until terminated; ``GET /stats`` answers
``{"requests": …, "distinct": …, "connections": …}`` (``distinct``: different last user turns).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from eagle3_pipeline.generation.capabilities import PROBE_PREFIX


@dataclass(frozen=True)
class Reply:
    """How to answer one request."""

    status: int = 200
    payload: dict[str, Any] | None = None  # JSON body; None: an echo completion (200) or an error object
    headers: Mapping[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # answer this much later
    hang: bool = False  # never answer (the handler waits until the server stops)
    truncate_to: int | None = None  # send only the first N bytes of the body, with a matching Content-Length
    reset: bool = False  # drop the connection with a TCP reset instead of answering


Script = Callable[[dict[str, Any], int], Reply]


def echo_completion(
    body: dict[str, Any],
    completion_tokens: int = 5,
    finish_reason: str = "stop",
    usage: dict[str, Any] | None = None,
    **message: Any,
) -> dict[str, Any]:
    """A chat completion that echoes the last turn; extra keyword arguments go into the message
    (e.g. ``reasoning_content=…``); ``usage`` replaces the default usage block ({} for none)."""
    last = body["messages"][-1]["content"]
    default_usage = {
        "prompt_tokens": 11,
        "completion_tokens": completion_tokens,
        "total_tokens": 11 + completion_tokens,
    }
    return {
        "id": "cmpl-test",
        "object": "chat.completion",
        "model": body.get("model", "fake"),
        "choices": [
            {
                "index": 0,
                "finish_reason": finish_reason,
                "message": {"role": "assistant", "content": f"echo: {last[:40]}", **message},
            }
        ],
        "usage": default_usage if usage is None else usage,
    }


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that drops its connection (killed, timed out) is not the server's error."""


@dataclass
class FakeOpenAI:
    delay_s: float = 0.0
    script: Script | None = None
    # The speed of a default echo answer: it has `completion_tokens` tokens and takes
    # `token_delay_s` per token to "generate" (a slow or fast backend for the planner's tests).
    token_delay_s: float = 0.0
    completion_tokens: int = 5
    record: bool = True  # keep every request body and header set (off for the benchmark)
    tokenize: Callable[[str], list[int]] | None = None  # answers POST /tokenize; None: 404
    max_model_len: int | None = None  # reported by GET /v1/models; None: not reported
    server_info: dict[str, Any] | None = None  # answers GET /server_info; None: 404
    tokenize_requests: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    probe_requests: list[dict[str, Any]] = field(default_factory=list)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    contents: Counter[str] = field(default_factory=Counter)
    connections: set[int] = field(default_factory=set)
    in_flight: int = 0
    peak_in_flight: int = 0
    _server: _Server | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "requests": sum(self.contents.values()),
                "distinct": len(self.contents),
                "connections": len(self.connections),
            }

    def start(self, port: int = 0) -> FakeOpenAI:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, data: bytes, headers: Mapping[str, str] = {}) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                path = self.path.rstrip("/")
                if path in ("/server_info", "/get_server_info"):
                    info = fake.server_info
                    self._send(404 if info is None else 200, json.dumps(info or {"detail": "Not Found"}).encode())
                    return
                card: dict[str, Any] = {"id": "fake", "object": "model"}
                if fake.max_model_len is not None:
                    card["max_model_len"] = fake.max_model_len
                models = {"object": "list", "data": [card]}
                payload = fake.stats() if path.endswith("/stats") else models
                self._send(200, json.dumps(payload).encode())

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                if self.path.rstrip("/") == "/tokenize":
                    self._tokenize(body)
                    return
                if str(body["messages"][-1]["content"]).startswith(PROBE_PREFIX):
                    with fake._lock:
                        fake.probe_requests.append(body)
                    self._answer(fake.script(body, 0) if fake.script else Reply(), body)
                    return
                with fake._lock:
                    if fake.record:
                        fake.requests.append(body)
                        fake.headers_seen.append(dict(self.headers))
                    fake.times.append(time.monotonic())
                    fake.contents[str(body["messages"][-1]["content"])] += 1
                    fake.connections.add(self.client_address[1])
                    fake.in_flight += 1
                    fake.peak_in_flight = max(fake.peak_in_flight, fake.in_flight)
                    number = len(fake.times)
                try:
                    self._answer(fake.script(body, number) if fake.script else Reply(), body)
                finally:
                    with fake._lock:
                        fake.in_flight -= 1

            def _tokenize(self, body: dict[str, Any]) -> None:
                with fake._lock:
                    fake.tokenize_requests.append({**body, "authorization": self.headers.get("Authorization")})
                if fake.tokenize is None:
                    self._send(404, json.dumps({"detail": "Not Found"}).encode())
                    return
                tokens = fake.tokenize(str(body["prompt"]))
                self._send(200, json.dumps({"tokens": tokens, "count": len(tokens), "max_model_len": 4096}).encode())

            def _answer(self, reply: Reply, body: dict[str, Any]) -> None:
                if fake.delay_s or reply.delay_s:
                    time.sleep(fake.delay_s + reply.delay_s)
                if reply.hang:
                    fake._stopping.wait()
                    self.close_connection = True
                    return
                if reply.reset:
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return
                if reply.payload is not None:
                    payload = reply.payload
                elif reply.status == 200:
                    time.sleep(fake.token_delay_s * fake.completion_tokens)
                    payload = echo_completion(body, fake.completion_tokens)
                else:
                    payload = {"error": {"message": "scripted failure", "code": reply.status}}
                data = json.dumps(payload).encode()
                self._send(
                    reply.status, data[: reply.truncate_to] if reply.truncate_to is not None else data, reply.headers
                )

        self._server = _Server(("127.0.0.1", port), Handler)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def main() -> None:
    parser = argparse.ArgumentParser(description="a zero-work OpenAI-compatible server on loopback")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args()
    server = FakeOpenAI(delay_s=args.delay_s, record=False).start(args.port)
    print(server.base_url, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
