"""A stand-in for ``vllm serve`` with ``extract_hidden_states`` and its ExampleHiddenStatesConnector:
a real HTTP server on 127.0.0.1, backed by transformers on the CPU. It stands in for vLLM itself and
nothing else, where real vLLM (``eagle3_pipeline_tests/real_vllm/``) cannot be made to misbehave: a server
that runs other ids than it was sent (``rewrite_prompt``). Its port belongs to the test process, whose
command line shows no layer ids: the extractor refuses it as a whole (``VllmTarget.check_layers``), so
its tests use the source directly.

What it reproduces (vllm-project/vllm ``docs/features/speculative_decoding/extract_hidden_states.md``
and ``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``):

- ``GET /v1/models``: the one served model;
- ``POST /v1/completions`` with ``prompt`` a list of token ids: one forward of the prompt; with
  ``return_token_ids`` the choice carries ``prompt_token_ids`` (and the greedy ``token_ids``);
  the top-level ``kv_transfer_params.hidden_states_path`` names the request's file;
- the connector's file ``{request_id}.safetensors`` under its ``shared_storage_path``, written under
  an exclusive ``flock`` on ``{file}.lock`` (the newer connector's synchronisation): ``hidden_states``
  [T, len(layer_ids), H] and ``token_ids`` [T]; id ``i < N`` is the residual stream entering layer
  ``i`` (vLLM's ``aux_hidden_states.append(hidden_states + residual)`` before the layer), id ``N``
  the last layer's output before the final norm.

The states are float32 (the model as the transformers extractor loads it on the CPU); a real server
writes its model dtype (bf16). ``rewrite_prompt`` changes the ids the "server" runs, for the
mismatch test.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from eagle3_pipeline.target.folder import decoder


class VllmStandin:
    def __init__(
        self,
        model: Any,
        served: str,
        layer_ids: Sequence[int],
        storage: Path,
        rewrite_prompt: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        self.model = model
        self.served = served
        self.layer_ids = list(layer_ids)
        self.storage = storage
        self.rewrite_prompt = rewrite_prompt
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def states(self, ids: list[int]) -> tuple[Any, int]:
        """``hidden_states`` [T, layers, H] as the connector saves them, and the greedy next token."""
        import torch

        stack = decoder(self.model)
        layers = list(stack.layers)
        caught: dict[int, Any] = {}
        handles = []
        for layer in self.layer_ids:
            if layer < len(layers):

                def pre(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], layer: int = layer) -> None:
                    caught[layer] = args[0] if args else kwargs["hidden_states"]

                handles.append(layers[layer].register_forward_pre_hook(pre, with_kwargs=True))
            else:

                def post(_module: Any, _inputs: Any, output: Any, layer: int = layer) -> None:
                    caught[layer] = output[0] if isinstance(output, tuple) else output

                handles.append(layers[-1].register_forward_hook(post))
        tokens = torch.tensor([ids], dtype=torch.long)
        try:
            with self._lock, torch.inference_mode():
                out = stack(
                    input_ids=tokens,
                    attention_mask=torch.ones_like(tokens),
                    position_ids=torch.arange(len(ids)).unsqueeze(0),
                    use_cache=False,
                )
                next_token = int(self.model.lm_head(out.last_hidden_state[:, -1]).argmax(-1))
        finally:
            for handle in handles:
                handle.remove()
        return torch.stack([caught[i][0] for i in self.layer_ids], dim=1).contiguous(), next_token

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        import torch
        from safetensors.torch import save_file

        prompt = [int(i) for i in body["prompt"]]
        ran = self.rewrite_prompt(prompt) if self.rewrite_prompt else prompt
        request_id = f"cmpl-{uuid.uuid4().hex}-0"
        filename = self.storage / f"{request_id}.safetensors"
        lock_fd = os.open(f"{filename}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            hidden_states, next_token = self.states(ran)
            save_file({"hidden_states": hidden_states, "token_ids": torch.tensor(ran)}, str(filename))
        finally:
            os.close(lock_fd)
        choice: dict[str, Any] = {"index": 0, "text": "", "finish_reason": "length", "token_ids": [next_token]}
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = ran
        return {
            "id": request_id,
            "object": "text_completion",
            "model": self.served,
            "choices": [choice],
            "usage": {"prompt_tokens": len(ran), "completion_tokens": 1, "total_tokens": len(ran) + 1},
            "kv_transfer_params": {"hidden_states_path": str(filename)},
        }

    def start(self) -> VllmStandin:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, {"object": "list", "data": [{"id": standin.served, "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                if self.path.rstrip("/") != "/v1/completions" or body.get("model") != standin.served:
                    self._send(404, {"error": {"message": f"no route {self.path} for model {body.get('model')!r}"}})
                    return
                with standin._lock:
                    standin.requests.append(body)
                self._send(200, standin.complete(body))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
