"""A loopback stand-in for SGLang or vLLM serving with and without a drafter (no GPU here).

Run as the benchmark's launch command:
``python -m eagle3_pipeline_tests.drafter.fake_spec_server --kind sglang|vllm --port N
[--speculative-steps K --tokens-per-step A]``. Every request generates exactly ``max_new_tokens`` /
``max_tokens`` tokens; with speculation each verify step yields ``A`` tokens (the last one fewer), and
the server reports it the way the real ones do:

- sglang: ``POST /generate`` → ``meta_info {completion_tokens, spec_verify_ct, spec_accept_length}``
  (``spec_verify_ct`` only with speculation); with ``stream`` one ``data:`` chunk per step, its
  ``completion_tokens`` cumulative, ``output_ids`` the step's new tokens (ids 100, 101, …: no loop) and
  ``text`` cumulative, as SGLang's;
- vllm: ``POST /v1/completions`` → ``usage.completion_tokens``; with ``stream`` one chunk per step
  (``choices[0].text`` and, with ``return_token_ids``, ``choices[0].token_ids``: the step's new tokens),
  then the usage chunk (``stream_options.include_usage``) and ``[DONE]``; ``GET /metrics`` → the counters
  ``vllm:spec_decode_num_accepted_tokens_total``, ``vllm:spec_decode_num_drafts_total`` and, per draft
  position ``p < K``, ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="p"}`` (a step that
  accepts ``a`` drafts counts one at positions ``0 … a-1``, as vLLM's ``SpecDecodingStats`` does), and
  ``vllm:generation_tokens_total`` (the health gate's throughput check reads it).
Both answer ``/v1/chat/completions`` (the health gate's generation probe) and ``/v1/models``.
Each verify step (or plain decode step) sleeps ``--step-delay-s``, so speculation is faster here too.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Server(ThreadingHTTPServer):
    daemon_threads = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=["sglang", "vllm"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--speculative-steps", type=int, default=0)
    parser.add_argument("--tokens-per-step", type=int, default=1)
    parser.add_argument("--step-delay-s", type=float, default=0.0)
    args = parser.parse_args()
    speculative = args.speculative_steps > 0
    per_step = args.tokens_per_step if speculative else 1
    counters = {"accepted": 0, "drafts": 0, "generated": 0}
    per_position = [0] * args.speculative_steps
    lock = threading.Lock()

    def count(tokens: int) -> int:
        """Verify steps for ``tokens`` tokens; updates vLLM's counters."""
        steps = math.ceil(tokens / per_step)
        with lock:
            counters["generated"] += tokens
        if speculative:
            with lock:
                counters["drafts"] += steps
                counters["accepted"] += tokens - steps
                for step in range(steps):
                    for position in range(min(per_step, tokens - step * per_step) - 1):
                        per_position[position] += 1
        return steps

    def generate(tokens: int) -> int:
        steps = count(tokens)
        threading.Event().wait(steps * args.step_delay_s)
        return steps

    def chunks(tokens: int) -> list[int]:
        """The tokens each step yields, counted as ``generate`` counts them."""
        count(tokens)
        return [min(per_step, tokens - start) for start in range(0, tokens, per_step)]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: Any) -> None:
            pass

        def _send(self, payload: Any, content_type: str = "application/json") -> None:
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, events: Any) -> None:
            """Server-sent events, each after a step's delay; the connection closes at the end."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for event in events:
                threading.Event().wait(args.step_delay_s)
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

        def _sglang_stream(self, tokens: int, prompt: int) -> Any:
            done = 0
            steps = chunks(tokens)
            for step, n in enumerate(steps, start=1):
                done += n
                meta: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": done}
                if speculative and step == len(steps):
                    meta.update(spec_verify_ct=step, spec_accept_length=done / step)
                yield {"text": "x" * done, "output_ids": list(range(100 + done - n, 100 + done)), "meta_info": meta}

        def _vllm_stream(self, tokens: int, ids: bool) -> Any:
            done = 0
            for n in chunks(tokens):
                new_ids = list(range(100 + done, 100 + done + n))
                done += n
                yield {"choices": [{"text": "x" * n, **({"token_ids": new_ids} if ids else {})}]}
            yield {"choices": [], "usage": {"completion_tokens": tokens}}

        def do_GET(self) -> None:
            if self.path == "/metrics":
                lines = [
                    "# TYPE vllm:generation_tokens counter",
                    f'vllm:generation_tokens_total{{engine="0"}} {counters["generated"]}',
                    "# TYPE vllm:spec_decode_num_accepted_tokens counter",
                    f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {counters["accepted"]}',
                    "# TYPE vllm:spec_decode_num_drafts counter",
                    f'vllm:spec_decode_num_drafts_total{{engine="0"}} {counters["drafts"]}',
                    "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
                    *(
                        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{p}"}} {n}'
                        for p, n in enumerate(per_position)
                    ),
                ]
                self._send("\n".join(lines) + "\n", "text/plain")
            else:
                self._send({"object": "list", "data": [{"id": "fake-target", "object": "model"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            if self.path == "/generate" and args.kind == "sglang" and body.get("stream"):
                self._stream(
                    self._sglang_stream(int(body["sampling_params"]["max_new_tokens"]), len(body["input_ids"]))
                )
            elif self.path == "/v1/completions" and args.kind == "vllm" and body.get("stream"):
                self._stream(self._vllm_stream(int(body["max_tokens"]), bool(body.get("return_token_ids"))))
            elif self.path == "/generate" and args.kind == "sglang":
                tokens = int(body["sampling_params"]["max_new_tokens"])
                steps = generate(tokens)
                meta: dict[str, Any] = {"prompt_tokens": len(body["input_ids"]), "completion_tokens": tokens}
                if speculative:
                    meta.update(spec_verify_ct=steps, spec_accept_length=tokens / steps)
                self._send({"text": "x" * tokens, "output_ids": list(range(100, 100 + tokens)), "meta_info": meta})
            elif self.path == "/v1/completions" and args.kind == "vllm":
                tokens = int(body["max_tokens"])
                generate(tokens)
                self._send(
                    {
                        "object": "text_completion",
                        "choices": [
                            {
                                "text": "x" * tokens,
                                "finish_reason": "length",
                                "token_ids": list(range(100, 100 + tokens)),
                            }
                        ],
                        "usage": {"completion_tokens": tokens},
                    }
                )
            elif self.path == "/v1/chat/completions":
                message = {"role": "assistant", "content": "OK"}
                self._send(
                    {
                        "object": "chat.completion",
                        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                        "usage": {"completion_tokens": 1},
                    }
                )
            else:
                self.send_error(404)

    server = _Server(("127.0.0.1", args.port), Handler)
    server.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
