"""Every SGLang name the ``backend: sglang`` worker uses (``SGLANG_USES``: modules, classes,
methods, attributes, the keyword parameters it passes and how many positional ones) is in the
source of the pinned release, read from its wheel with ``zipfile`` and ``ast`` — nothing of SGLang is
imported (its CUDA parts cannot load here).

The wheel comes from ``pip download --no-deps sglang==SGLANG_VERSION`` into
``~/.cache/eagle3_pipeline/wheels`` (kept between sessions). When the download fails the test
fails with ``CI`` set, and is skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eagle3_pipeline.config import HiddenStatesConfig
from eagle3_pipeline.hidden_states.sglang_capture import SGLANG_USES, SGLANG_VERSION
from eagle3_pipeline_tests.hidden_states.sglang_source import SourceTree, check_uses

PACKAGE = f"sglang=={SGLANG_VERSION}"


def wheel_cache() -> Path:
    return Path.home() / ".cache" / "eagle3_pipeline" / "wheels"


def pinned_wheel() -> Path:
    folder = wheel_cache()
    found = sorted(folder.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
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
        PACKAGE,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        problem = None if done.returncode == 0 else (done.stderr or done.stdout).strip()[-800:]
    except (OSError, subprocess.TimeoutExpired) as exc:
        problem = str(exc)
    found = sorted(folder.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if problem or not found:
        message = f"could not download {PACKAGE} with `{' '.join(command)}`: {problem or 'no wheel written'}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found[0]


def test_every_sglang_name_the_worker_uses_is_in_the_pinned_release() -> None:
    wheel = pinned_wheel()
    with zipfile.ZipFile(wheel) as archive:
        present = set(archive.namelist())

        def read(path: str) -> str | None:
            return archive.read(path).decode() if path in present else None

        problems = check_uses(SourceTree(read), SGLANG_USES)
        version = read("sglang/_version.py") or ""
    print(f"\n-- {wheel.name}: {len(SGLANG_USES)} names checked")
    for use in SGLANG_USES:
        details = ", ".join(
            filter(
                None,
                [
                    f"keywords {list(use.keywords)}" if use.keywords else "",
                    f"{use.positional} positional" if use.positional else "",
                ],
            )
        )
        print(f"   {use.kind:9} {use.module}.{use.name}" + (f" ({details})" if details else ""))
    assert problems == [], "\n".join(problems)
    assert f"__version__ = version = '{SGLANG_VERSION}'" in version


def test_the_settings_name_the_pinned_version() -> None:
    fields = HiddenStatesConfig.model_fields
    assert f"sglang {SGLANG_VERSION}" in str(fields["backend"].description)
    assert f"sglang=={SGLANG_VERSION}" in str(fields["sglang_python"].description)
