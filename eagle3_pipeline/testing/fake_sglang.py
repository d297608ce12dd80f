"""`FakeSglang`: a real process with argv `python -m sglang.launch_server --port P --tp-size 8` (a tiny
module on PYTHONPATH) serving /health, /health_generate, /v1/chat/completions and /metrics on loopback,
with `sglang::scheduler_TP<i>` children; a JSON scenario file scripts it. `spec_for` is the health
tick's view of it. A stand-in for SGLang's engine, which needs GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_pipeline.health import ServerSpec
from eagle3_pipeline.testing.process_tools import free_port, kill_group, wait_until, write_atomic

_LAUNCH_SERVER = '''"""Stand-in for `python -m sglang.launch_server`: a real loopback HTTP server, scripted by the
JSON file named in FAKE_SGLANG_SCENARIO, with `sglang::scheduler_TP<i>` child processes. With
`--speculative-num-steps K` its native `/generate` (streamed as one chunk when asked) reports `spec_verify_ct`
as SGLang's meta_info does (each verify step yields the scenario's `accept_length` tokens, default 2; a prompt
holding the scenario's `loop_token` is answered by that token over and over, `loop_accept_length` tokens a step,
default 4); a `--speculative-draft-model-path` folder without a config.json makes it exit during start-up, as
SGLang does when it cannot load the drafter (a path that is no folder here is taken as one on another host).
`--config FILE.yaml` with `api-key` makes it require `Authorization: Bearer <key>` on every route but /health*
and /metrics, as SGLang's API-key middleware does (a YAML config merged into the arguments: SGLang's
ConfigArgumentMerger). On SIGTERM it shuts its scheduler children down itself and exits, as SGLang's
launch_server does (its log says so: the graceful
stop's test); with FAKE_SGLANG_ABANDON=1 it exits leaving them running."""
import argparse, json, math, os, signal, subprocess, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SCENARIO = os.environ["FAKE_SGLANG_SCENARIO"]
_tokens = [1000.0]
_answered = [0]
_probes = [0]
_generated = [0]
_lock = threading.Lock()
API_KEY = None


def scenario():
    with open(SCENARIO) as handle:
        return json.load(handle)


def metrics(s):
    with _lock:
        if s.get("tokens", "advance") == "advance":
            _tokens[0] += 128
        tokens = _tokens[0]
    return (
        "# HELP sglang:generation_tokens_total Number of generation tokens processed.\\n"
        "# TYPE sglang:generation_tokens_total counter\\n"
        f'sglang:generation_tokens_total{{model_name="fake"}} {tokens}\\n'
        "# HELP sglang:num_running_reqs The number of running requests.\\n"
        "# TYPE sglang:num_running_reqs gauge\\n"
        f'sglang:num_running_reqs{{model_name="fake"}} {s.get("running", 0)}\\n'
    )


COMPLETION = json.dumps({
    "id": "fake", "object": "chat.completion", "model": "fake",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "OK"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}).encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def refused(self):
        if API_KEY is None or self.path.startswith(("/health", "/metrics")):
            return False
        if self.headers.get("Authorization") == "Bearer " + API_KEY:
            return False
        self.reply(401, b'{"error": "Unauthorized"}')
        return True

    def do_GET(self):
        if self.refused():
            return
        s = scenario()
        if s.get("hang_all"):
            time.sleep(3600)
        if self.path == "/health":
            self.reply(s.get("health", 200), b"")
        elif self.path == "/health_generate":
            with _lock:
                _probes[0] += 1
                loading = _probes[0] <= s.get("unready_probes", 0)
            if s.get("generate") == "hang":  # SGLang answers 503 once its HEALTH_CHECK_TIMEOUT (20 s) is over
                time.sleep(s.get("health_timeout_s", 20))
                self.reply(503, b"")
            elif loading:  # as a server still loading its weights answers
                self.reply(503, b"")
            else:
                self.generate(s, b"")
        elif self.path == "/metrics":
            self.reply(200, metrics(s).encode(), "text/plain; version=0.0.4")
        else:
            self.reply(404, b"")

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.refused():
            return
        s = scenario()
        if s.get("hang_all"):
            time.sleep(3600)
        if self.path == "/v1/chat/completions":
            with _lock:
                _answered[0] += 1
                crash = 0 < s.get("crash_after", 0) <= _answered[0]
            crash = crash or bool(s.get("poison") and s["poison"].encode() in body)
            if crash:  # as a GPU fault takes a server down: an error in the log, the whole group gone
                print("RuntimeError: CUDA error: an illegal memory access was encountered", file=sys.stderr, flush=True)
                os.killpg(0, signal.SIGKILL)
            self.generate(s, COMPLETION)
        elif self.path == "/generate":
            request = json.loads(body)
            tokens = int(request["sampling_params"]["max_new_tokens"])
            with _lock:
                _generated[0] += 1
                at_once = _generated[0] <= s.get("no_verify_requests", 0)
            if at_once:  # an EOS straight from the prefill: SGLang leaves spec_verify_ct (0) out of meta_info
                tokens = 1
            meta = {"prompt_tokens": len(request["input_ids"]), "completion_tokens": tokens}
            looping = s.get("loop_token") in request["input_ids"]
            accept = s.get("loop_accept_length", 4.0) if looping else s.get("accept_length", 2.0)
            steps = math.ceil(tokens / float(accept))
            output = [s["loop_token"]] * tokens if looping else [100 + i for i in range(tokens)]
            end = s.get("think_end_token")
            if end is not None and end not in request["input_ids"]:  # thinking, its end marker, then the answer
                thinking = min(tokens, s.get("think_tokens", 0) + 1)
                output = [300 + i for i in range(thinking - 1)] + [end] + output[: tokens - thinking]
                steps = math.ceil(thinking / float(s.get("think_accept_length", 3.0))) + math.ceil(
                    (tokens - thinking) / float(accept)
                )
            if SPECULATIVE_STEPS and not at_once:
                meta.update(spec_verify_ct=steps, spec_accept_length=tokens / steps)
            answer = {"text": "x" * tokens, "output_ids": output, "meta_info": meta}
            if request.get("stream"):  # one chunk: SGLang's last, whose meta_info has the totals
                self.reply(200, f"data: {json.dumps(answer)}\\n\\ndata: [DONE]\\n\\n".encode(), "text/event-stream")
            else:
                self.reply(200, json.dumps(answer).encode())
        else:
            self.reply(404, b"")

    def generate(self, s, body):
        mode = s.get("generate", "ok")
        time.sleep(s.get("delay_s", 0))
        if mode == "hang":
            time.sleep(3600)
        if mode == "error":
            self.reply(500, b'{"error": "internal server error"}')
        else:
            self.reply(200, body)

    def reply(self, code, body, content_type="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


SPECULATIVE_STEPS = 0


def main():
    global SPECULATIVE_STEPS, API_KEY
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--speculative-num-steps", type=int, default=0)
    parser.add_argument("--speculative-draft-model-path")
    args, _ = parser.parse_known_args()
    SPECULATIVE_STEPS = args.speculative_num_steps
    if args.config is not None:
        import yaml

        with open(args.config) as handle:
            API_KEY = str(yaml.safe_load(handle)["api-key"])
    drafter = args.speculative_draft_model_path
    if drafter is not None and os.path.isdir(drafter) and not os.path.isfile(os.path.join(drafter, "config.json")):
        print(f"ValueError: cannot load the draft model at {drafter}: no config.json", file=sys.stderr, flush=True)
        sys.exit(1)
    ranks = int(os.environ.get("FAKE_SGLANG_RANKS", args.tp_size))
    children = [subprocess.Popen([f"sglang::scheduler_TP{i}", "infinity"], executable="sleep") for i in range(ranks)]

    def shut_down(signum, frame):
        if os.environ.get("FAKE_SGLANG_ABANDON") == "1":  # a leader that exits without its children
            print("Received SIGTERM: exiting, the scheduler processes left running", file=sys.stderr, flush=True)
            os._exit(0)
        print("Received SIGTERM: shutting down the scheduler processes", file=sys.stderr, flush=True)
        for child in children:
            child.terminate()
        for child in children:
            child.wait()
        print(f"Shut down {len(children)} scheduler process(es); exiting", file=sys.stderr, flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, shut_down)
    server = None
    if os.environ.get("FAKE_SGLANG_BIND", "1") == "1":
        ThreadingHTTPServer.daemon_threads = True
        server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    open(os.environ["FAKE_SGLANG_READY"], "w").close()
    if server is not None:
        server.serve_forever()
    else:
        signal.pause()


if __name__ == "__main__":
    main()
'''


class FakeSglang:
    """A scripted `python -m sglang.launch_server --port P --tp-size N` process tree."""

    def __init__(self, workdir: Path, tp_size: int = 8) -> None:
        self.workdir = workdir
        self.tp_size = tp_size
        self.port = free_port()
        self.scenario_path = workdir / "scenario.json"
        self.process: subprocess.Popen[bytes] | None = None
        package = workdir / "pythonpath" / "sglang"
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text("")
        (package / "launch_server.py").write_text(_LAUNCH_SERVER)
        self.set()

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("the fake sglang server is not running")
        return self.process.pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, **scenario: Any) -> None:
        """health (HTTP code), generate (ok|hang|error), delay_s (before each generation), tokens
        (advance|frozen), running, hang_all, crash_after (the Nth chat completion of a server process
        kills its process group, a CUDA error in its log), poison (so does a chat completion whose body
        holds this text), health_timeout_s (how long a hung server's /health_generate waits before its
        503; default SGLang's 20), unready_probes (the first N /health_generate of a server process answer
        503, as while it loads), no_verify_requests (the first N native /generate requests answer one
        token and no spec_verify_ct, as SGLang does for 0 verify steps), loop_token and loop_accept_length (a
        prompt holding loop_token is answered by it repeated, loop_accept_length tokens per verify step),
        think_end_token, think_tokens and think_accept_length (a prompt without think_end_token is answered by
        think_tokens thinking tokens and think_end_token at think_accept_length tokens a step, default 3, then
        the answer; one holding it, by the answer alone)."""
        write_atomic(self.scenario_path, json.dumps(scenario))

    def start(self, *, ranks: int | None = None, bind: bool = True, args: Sequence[str] = ()) -> FakeSglang:
        """Start it; ``args`` go after its own (e.g. ``--speculative-num-steps 3``)."""
        ready = self.workdir / "ready"
        ready.unlink(missing_ok=True)
        env = {
            **os.environ,
            "PYTHONPATH": str(self.workdir / "pythonpath"),
            "FAKE_SGLANG_SCENARIO": str(self.scenario_path),
            "FAKE_SGLANG_READY": str(ready),
            "FAKE_SGLANG_RANKS": str(self.tp_size if ranks is None else ranks),
            "FAKE_SGLANG_BIND": "1" if bind else "0",
        }
        argv = [sys.executable, "-m", "sglang.launch_server", "--port", str(self.port), "--tp-size", str(self.tp_size)]
        argv += list(args)
        self.process = subprocess.Popen(argv, env=env, cwd=self.workdir, start_new_session=True)
        wait_until(ready.exists, 15, "fake sglang server")
        return self

    def stop(self) -> None:
        if self.process is not None:
            kill_group(self.process)
            self.process = None


def spec_for(server: FakeSglang, **overrides: Any) -> ServerSpec:
    options: dict[str, Any] = {
        "kind": "sglang",
        "port": server.port,
        "base_url": server.base_url,
        "model": "fake",
        "tp_size": server.tp_size,
        "process_pattern": "",
    }
    options.update(overrides)
    return ServerSpec(**options)
