"""Benchmark: our generation client against a bare asyncio loop, both talking to a zero-work
OpenAI-compatible server in another process; then a kill at ~50 % and a resume.

Measured in the same run and printed as ratios:
  * throughput of ``eagle3_pipeline.generation.generate`` (checkpoint on, default fsync policy)
    over a bare loop — asyncio, a semaphore, one shared httpx client, no checkpoint (target ≥ 0.8);
    and over a bare loop with one httpx client per worker (the connection layout ours uses), which
    isolates what the checkpoint, retries, budget and progress cost;
  * a generation process killed with SIGKILL at ~50 % and resumed: duplicates (0), finished
    responses lost (0), requests sent again (≤ concurrency).

    .venv/bin/python -m benchmarks.generation_client [--requests 20000] [--concurrency 150]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

from eagle3_pipeline.config import GenerationConfig
from eagle3_pipeline.generation import Endpoint, ResponseCheckpoint, generate
from eagle3_pipeline.records import PromptRecord, content_id

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 16


def prompts(n: int) -> list[PromptRecord]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"benchmark prompt number {i}: say something short."}]
        out.append(PromptRecord(content_id(messages, None), "bench", messages, None, "short", 12, i))
    return out


def settings(concurrency: int) -> GenerationConfig:
    return GenerationConfig(max_tokens=MAX_TOKENS, concurrency={"short": concurrency, "long": 1})  # type: ignore[arg-type]


def body(prompt: PromptRecord) -> dict[str, object]:
    return {"model": "m", "messages": prompt.messages, "max_tokens": MAX_TOKENS, "temperature": 0.0}


async def bare_shared_client(url: str, items: list[PromptRecord], concurrency: int) -> None:
    """What a script usually does: one client, a semaphore, gather everything."""
    limit = asyncio.Semaphore(concurrency)
    pool = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=pool, timeout=60) as client:

        async def one(prompt: PromptRecord) -> None:
            async with limit:
                reply = await client.post(url + "/chat/completions", json=body(prompt))
                reply.json()["choices"][0]["message"]["content"]

        await asyncio.gather(*(one(p) for p in items))


async def bare_client_per_worker(url: str, items: list[PromptRecord], concurrency: int) -> None:
    """The same work with ours' connection layout: each of `concurrency` workers owns a client
    (sharing one TLS context, as ours does: building one per client costs ~20 ms of CPU)."""
    queue = iter(items)
    tls = httpx.create_ssl_context()

    async def worker() -> None:
        async with httpx.AsyncClient(verify=tls, limits=httpx.Limits(max_connections=1), timeout=60) as client:
            for prompt in queue:
                reply = await client.post(url + "/chat/completions", json=body(prompt))
                reply.json()["choices"][0]["message"]["content"]

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def ours(url: str, items: list[PromptRecord], concurrency: int, folder: Path) -> None:
    checkpoint = ResponseCheckpoint(folder / "ck.jsonl", "interval")
    summary = generate(
        items,
        lambda: [Endpoint(url, "m")],
        settings=settings(concurrency),
        checkpoint=checkpoint,
        errors_path=folder / "err.jsonl",
    )
    assert summary.generated == len(items) and summary.failed == 0, summary.error_examples


def rate(run: Callable[[], None], n: int) -> float:
    started = time.perf_counter()
    run()
    return n / (time.perf_counter() - started)


BareLoop = Callable[[str, list[PromptRecord], int], Coroutine[Any, Any, None]]


def bare(loop: BareLoop, url: str, items: list[PromptRecord], c: int) -> Callable[[], None]:
    return lambda: asyncio.run(loop(url, items, c))


class Server:
    """The zero-work server (eagle3_pipeline.testing.fake_openai) as a separate process."""

    def __init__(self) -> None:
        command = [sys.executable, "-m", "eagle3_pipeline.testing.fake_openai"]
        self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().strip()

    def stats(self) -> dict[str, int]:
        return dict(httpx.get(self.url + "/stats", timeout=10).json())

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def finished_ids(path: Path) -> list[str]:
    data = path.read_bytes() if path.exists() else b""
    return [json.loads(line)["id"] for line in data[: data.rfind(b"\n") + 1].splitlines()]


def worker_command(url: str, checkpoint: Path, n: int, c: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "benchmarks.generation_client",
        "--worker",
        url,
        str(checkpoint),
        "--requests",
        str(n),
        "--concurrency",
        str(c),
    ]


def kill_and_resume(n: int, c: int, folder: Path) -> None:
    server = Server()
    try:
        checkpoint = folder / "kill.jsonl"
        proc = subprocess.Popen(worker_command(server.url, checkpoint, n, c), cwd=REPO)
        while len(finished_ids(checkpoint)) < n // 2 and proc.poll() is None:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        at_kill = finished_ids(checkpoint)
        subprocess.run(worker_command(server.url, checkpoint, n, c), cwd=REPO, check=True)
        final = finished_ids(checkpoint)
        stats = server.stats()
    finally:
        server.stop()
    expected = {p.id for p in prompts(n)}
    print(f"kill at ~50 % and resume ({n} requests, concurrency {c}, fresh server)")
    print(f"  killed with {len(at_kill)} of {n} finished; after the resume {len(set(final) & expected)} of {n}")
    print(
        f"  duplicates: {len(final) - len(set(final))}   finished responses lost: {len(set(at_kill) - set(final))}   "
        f"requests sent again: {stats['requests'] - stats['distinct']} (≤ {c})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=150)
    parser.add_argument("--worker", nargs=2, metavar=("URL", "CHECKPOINT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    n, c = args.requests, args.concurrency
    if args.worker:
        url, checkpoint = args.worker
        generate(
            prompts(n),
            lambda: [Endpoint(url, "m")],
            settings=settings(c),
            checkpoint=ResponseCheckpoint(Path(checkpoint)),
            errors_path=Path(checkpoint + ".err"),
        )
        return

    items = prompts(n)
    server = Server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            warm = items[:1000]
            bare(bare_client_per_worker, server.url, warm, c)()
            ours(server.url, warm, c, folder / "warm")
            print(f"generation client benchmark: {n} requests, concurrency {c}, zero-work server in another process")
            shared = rate(bare(bare_shared_client, server.url, items, c), n)
            print(f"  bare loop, one shared httpx client, semaphore, no checkpoint: {shared:8.0f} req/s")
            lanes = rate(bare(bare_client_per_worker, server.url, items, c), n)
            print(f"  bare loop, one httpx client per worker, no checkpoint:        {lanes:8.0f} req/s")
            mine = rate(lambda: ours(server.url, items, c, folder / "ours"), n)
            print(f"  ours: generate(), checkpoint on (fsync every 1 s):            {mine:8.0f} req/s")
            print(f"  ratio ours / bare loop (shared client):     {mine / shared:6.2f}   (target >= 0.8)")
            print(
                f"  ratio ours / bare loop (client per worker): {mine / lanes:6.2f}   (cost of "
                "checkpoint, retries, budget, progress)"
            )
            print(f"  server: {server.stats()}")
            kill_and_resume(n, c, folder)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
