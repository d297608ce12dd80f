"""A phase's reporter (:class:`eagle3_pipeline.compute.Reporter`) that keeps what the phase said, for the
tests that call a phase in process: its log lines, its progress points, and a hook per point."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


class Recorder:
    """``lines``: every log line; ``points``: every progress point, as a dict; ``on_progress``: called
    with each point as it comes (e.g. to kill the phase midway)."""

    def __init__(self, on_progress: Callable[[Mapping[str, Any]], None] | None = None) -> None:
        self.lines: list[str] = []
        self.points: list[dict[str, Any]] = []
        self.on_progress = on_progress

    def log(self, message: str) -> None:
        self.lines.append(message)

    def progress(self, metrics: Mapping[str, Any]) -> None:
        self.points.append(dict(metrics))
        if self.on_progress is not None:
            self.on_progress(metrics)
