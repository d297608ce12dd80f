"""A real generation process killed with SIGKILL at random points, then resumed: no duplicates, no
finished response lost, at most the requests in flight sent again."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from eagle3_pipeline.generation import Endpoint, ResponseCheckpoint, generate
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline.testing.generation_runs import make_prompts, settings

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 400
CONCURRENCY = 8
KILLS = 4


def worker_main() -> None:
    """The generation process: ``worker_main BASE_URL CHECKPOINT``; fsync after every record."""
    base_url, checkpoint = sys.argv[1], Path(sys.argv[2])
    config = settings(concurrency={"short": CONCURRENCY, "long": 1}, fsync="always")
    endpoints = [Endpoint(base_url, "m")]
    generate(
        make_prompts(PROMPTS),
        lambda: endpoints,
        settings=config,
        checkpoint=ResponseCheckpoint(checkpoint, "always"),
        errors_path=checkpoint.with_suffix(".err"),
    )


def start_worker(base_url: str, checkpoint: Path) -> subprocess.Popen[bytes]:
    code = "from eagle3_pipeline_tests.generation.test_kill import worker_main; worker_main()"
    return subprocess.Popen([sys.executable, "-c", code, base_url, str(checkpoint)], cwd=REPO, stderr=subprocess.PIPE)


def finished_ids(path: Path) -> list[str]:
    """Ids of the complete lines, in file order (a torn last line is not a finished response)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    return [json.loads(line)["id"] for line in data[: data.rfind(b"\n") + 1].splitlines()]


def test_sigkill_at_random_points_then_resume(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    fake_openai.delay_s = 0.01
    checkpoint = tmp_path / "ck.jsonl"
    rng = random.Random(int(os.environ.get("KILL_TEST_SEED", "20261202")))
    kept: list[str] = []
    for _ in range(KILLS):
        target = len(kept) + rng.randint(10, 60)
        proc = start_worker(fake_openai.base_url, checkpoint)
        while len(finished_ids(checkpoint)) < target and proc.poll() is None:
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.02))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        now = finished_ids(checkpoint)
        assert now[: len(kept)] == kept, "finished responses were lost or rewritten"
        assert len(kept) < len(now) < PROMPTS, "the kill landed mid-generation"
        kept = now

    final = start_worker(fake_openai.base_url, checkpoint)
    assert final.wait(timeout=120) == 0, final.stderr.read().decode()[-2000:] if final.stderr else ""
    ids = finished_ids(checkpoint)
    assert checkpoint.read_bytes().endswith(b"\n")
    assert len(ids) == len(set(ids)) == PROMPTS, "every prompt answered exactly once"
    assert ids[: len(kept)] == kept
    assert set(ids) == {p.id for p in make_prompts(PROMPTS)}
    sent_again = sum(count - 1 for count in fake_openai.contents.values())
    assert sent_again <= KILLS * CONCURRENCY, "at most the requests in flight at each kill are sent again"
    assert set(ResponseCheckpoint(checkpoint).load()) == set(ids)
