"""The ``eagle3-pipeline`` command run as a process in the tests (a helper module, not a test)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path


def plan_cli(config: Path, *args: str, secret: str | None = None) -> str:
    """`eagle3-pipeline plan` on ``config`` as a process; its output, which must not show ``secret``."""
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_pipeline.cli", "plan", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert done.returncode == 0, done.stderr
    assert secret is None or secret not in done.stdout + done.stderr, "the API key leaked into the plan"
    return done.stdout


def run_on_a_terminal(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """``command`` with its stdout on a pseudo-terminal (so it draws its progress bar) and its stderr in
    ``cwd/stderr.txt``; its exit code and everything it drew."""
    parent, child = pty.openpty()
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=child, stderr=(cwd / "stderr.txt").open("wb")
    )
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(parent, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(parent)
    return proc.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")
