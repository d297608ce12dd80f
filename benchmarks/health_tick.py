"""Benchmark: a full health tick over SSH, as a ratio to one bare `exec true` round trip.

Both run on the same reused connection to a real sshd on loopback, against the health tests'
stand-ins (a fake SGLang process tree, scripted nvidia-smi/dmesg; see
eagle3_pipeline/testing/sshd_fixture.py). The two are measured alternately and the medians
of N repetitions compared; the target is a ratio of at most 3. Needs root and openssh-server.

    .venv/bin/python -m benchmarks.health_tick [--repetitions 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from eagle3_pipeline.health import TickState, run_health_tick
from eagle3_pipeline.testing.fake_sglang import FakeSglang, spec_for
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd, make_watched, thresholds_for


def _timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--repetitions", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fakebin = FakeBin(root / "fakebin")
        sshd = Sshd(root / "sshd", fakebin.dir).start()
        server = FakeSglang(root / "sglang")
        server.set(running=4)
        server.start()
        try:
            host = sshd.host()
            spec, thresholds = spec_for(server), thresholds_for(make_watched(root))
            host.run("exec true", timeout_s=10)  # connect once; both measurements reuse it
            state = TickState()

            def tick() -> None:
                nonlocal state
                report, state = run_health_tick(host, spec, thresholds, state)
                if not report.healthy:
                    raise RuntimeError(f"the benchmark fixture is not healthy: {report.summary()}")

            tick()
            bare, full = [], []
            for _ in range(args.repetitions):
                bare.append(_timed(lambda: host.run("exec true", timeout_s=10)))
                full.append(_timed(tick))
            host.close()
        finally:
            server.stop()
            sshd.stop()
    bare_ms, full_ms = statistics.median(bare) * 1000, statistics.median(full) * 1000
    print(f"health tick over SSH, median of {args.repetitions}:")
    print(f"  bare `exec true` round trip  {bare_ms:8.1f} ms")
    print(f"  full health tick             {full_ms:8.1f} ms")
    print(f"  ratio                        {full_ms / bare_ms:8.2f}x  (target <= 3x)")


if __name__ == "__main__":
    main()
