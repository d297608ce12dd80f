"""A released wheel fetched as a file to read (``pip download --no-deps --only-binary=:all:``), for the tests
that compare with SpecForge's or SGLang's own source. When the download fails the calling test is skipped
(failed under ``CI``: :mod:`eagle3_pipeline_tests.ci_skips`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def download_wheel(name: str, version: str, folder: Path, timeout_s: float) -> Path:
    """``name==version``'s wheel in ``folder``: the one already there, else downloaded into it."""
    pattern = f"{name}-{version}-*.whl"
    found = sorted(folder.glob(pattern))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    requirement = f"{name}=={version}"
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(folder),
        requirement,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
        problem = None if done.returncode == 0 else (done.stderr or done.stdout).strip()[-800:]
    except (OSError, subprocess.TimeoutExpired) as exc:
        problem = str(exc)
    found = sorted(folder.glob(pattern))
    if problem or not found:
        message = f"could not download {requirement} with `{' '.join(command)}`: {problem or 'no wheel written'}"
        pytest.skip(message)
    return found[0]
