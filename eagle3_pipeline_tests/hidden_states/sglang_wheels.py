"""SGLang release wheels as source to read (``zipfile``; nothing of SGLang is imported: its CUDA
parts cannot load here), from ``pip download --no-deps --only-binary=:all: sglang==VERSION`` into
``~/.cache/eagle3_pipeline/wheels`` (kept between sessions). When a download fails the calling test
is skipped, or fails under ``CI``."""

from __future__ import annotations

import functools
import zipfile
from pathlib import Path

from eagle3_pipeline_tests.hidden_states.sglang_source import SourceTree
from eagle3_pipeline_tests.wheels import download_wheel


def wheel_cache() -> Path:
    return Path.home() / ".cache" / "eagle3_pipeline" / "wheels"


def release_wheel(version: str) -> Path:
    return download_wheel("sglang", version, wheel_cache(), timeout_s=600)


@functools.cache
def wheel_source(version: str) -> tuple[SourceTree, str]:
    """The release's source tree and its ``sglang/_version.py``, one per process and release (the
    wheel stays open: the tree parses modules as they are asked for)."""
    archive = zipfile.ZipFile(release_wheel(version))
    present = set(archive.namelist())

    def read(path: str) -> str | None:
        return archive.read(path).decode() if path in present else None

    return SourceTree(read, sorted(present)), read("sglang/_version.py") or ""
