"""Where the SGLang stand-ins live (``sglang_standin/<release>`` and the ``core`` they share) and how a
test puts one on the path: in this process (:func:`active_standin`) or a child's (:func:`standin_pythonpath`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STANDIN = Path(__file__).parent / "sglang_standin"


def standin_path(version: str) -> list[Path]:
    """What goes on ``sys.path`` / ``PYTHONPATH`` for the stand-in of ``version``."""
    return [STANDIN / version, STANDIN / "core"]


def standin_pythonpath(version: str) -> str:
    return os.pathsep.join(str(p) for p in standin_path(version))


@contextmanager
def active_standin(version: str) -> Iterator[None]:
    """The stand-in ``sglang`` of ``version`` importable in this process, then forgotten (so another
    release's stand-in can follow in the same test)."""
    saved = list(sys.path)
    sys.path[:0] = [str(p) for p in standin_path(version)]
    try:
        yield
    finally:
        sys.path[:] = saved
        for name in [m for m in sys.modules if m.split(".")[0] in ("sglang", "sglang_standin_core")]:
            del sys.modules[name]
