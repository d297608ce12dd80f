"""The live processes of a process group on this machine, read from /proc: what a test checks is gone after a
server's stop."""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.managed.processes import parse_stat


def processes_of(pgid: int) -> list[int]:
    """Live processes of a process group on this machine (zombies aside)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            info = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
        if info.pgid == pgid and info.live:
            found.append(info.pid)
    return found
