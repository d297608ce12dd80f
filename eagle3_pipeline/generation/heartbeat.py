"""The generation heartbeat: a small JSON file saying that a dataset's generation really started
(the server answered and the health preflight passed) and when it last made progress.

The stall sensor measures quiet from `started_at`, never from the run's start, so a run that waits
for the `gpu` pool or for a server's start-up is not a stalled run. Written atomically."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Heartbeat:
    run_id: str
    started_at: float
    beat_at: float
    done: int


def heartbeat_path(artifacts_root: Path, dataset_id: str) -> Path:
    return Path(artifacts_root) / "responses" / f"{dataset_id}.heartbeat.json"


def _write(path: Path, beat: Heartbeat) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps(asdict(beat)))
    os.replace(staging, path)


class HeartbeatWriter:
    """One run's heartbeat for one dataset: :meth:`start` when generating begins, :meth:`beat` on progress."""

    def __init__(self, path: Path, run_id: str) -> None:
        self.path = path
        self.run_id = run_id
        self.started_at: float | None = None

    def start(self) -> None:
        self.started_at = time.time()
        _write(self.path, Heartbeat(self.run_id, self.started_at, self.started_at, 0))

    def beat(self, done: int) -> None:
        if self.started_at is not None:
            _write(self.path, Heartbeat(self.run_id, self.started_at, time.time(), done))


def read_heartbeat(path: Path) -> Heartbeat | None:
    """The heartbeat in `path`, or None when there is none or it is unreadable (a torn write)."""
    try:
        data = json.loads(path.read_text())
        return Heartbeat(str(data["run_id"]), float(data["started_at"]), float(data["beat_at"]), int(data["done"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
