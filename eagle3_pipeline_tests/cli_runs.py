"""The ``eagle3-pipeline`` command run as a process in the tests (a helper module, not a test)."""

from __future__ import annotations

import os
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
