"""SGLang release wheels as source to read (``zipfile``; nothing of SGLang is imported: its CUDA
parts cannot load here), from ``pip download --no-deps --only-binary=:all: sglang==VERSION`` into
``~/.cache/eagle3_pipeline/wheels`` (kept between sessions). When a download fails the calling test
fails with ``CI`` set, and is skipped otherwise."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eagle3_pipeline_tests.hidden_states.sglang_source import SourceTree


def wheel_cache() -> Path:
    return Path.home() / ".cache" / "eagle3_pipeline" / "wheels"


def release_wheel(version: str) -> Path:
    folder = wheel_cache()
    found = sorted(folder.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
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
        f"sglang=={version}",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        problem = None if done.returncode == 0 else (done.stderr or done.stdout).strip()[-800:]
    except (OSError, subprocess.TimeoutExpired) as exc:
        problem = str(exc)
    found = sorted(folder.glob(f"sglang-{version}-*.whl"))
    if problem or not found:
        message = f"could not download sglang=={version} with `{' '.join(command)}`: {problem or 'no wheel written'}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found[0]


@functools.cache
def wheel_source(version: str) -> tuple[SourceTree, str]:
    """The release's source tree and its ``sglang/_version.py``, one per process and release (the
    wheel stays open: the tree parses modules as they are asked for)."""
    archive = zipfile.ZipFile(release_wheel(version))
    present = set(archive.namelist())

    def read(path: str) -> str | None:
        return archive.read(path).decode() if path in present else None

    return SourceTree(read, sorted(present)), read("sglang/_version.py") or ""
