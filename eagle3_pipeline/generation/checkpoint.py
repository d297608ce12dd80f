"""The crash-safe, append-only JSONL checkpoint of finished responses, keyed by prompt id, and the
per-dataset errors file.

Each finished response is one ``write`` of one line on a descriptor opened with ``O_APPEND``, so it
is in the kernel the moment it arrives and survives ``kill -9``; ``fsync`` (never / every
``fsync_interval_s`` / after every line) decides what also survives a power cut. Reading is by id:
a torn last line is ignored (and cut by the next writer, so its request is redone) and an id
written twice is read once. One writer per file at a time, enforced with an exclusive lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

FsyncPolicy = Literal["never", "interval", "always"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or used (corrupt in the middle, or locked by another writer)."""


def _append_fd(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


def _write_all(fd: int, data: bytes) -> None:
    """Write every byte (a short write only happens when the disk is full or on a signal)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class ResponseCheckpoint:
    """Append-only JSONL of finished responses, one JSON object per line, keyed by ``id``."""

    def __init__(self, path: Path, fsync: FsyncPolicy = "interval", fsync_interval_s: float = 1.0) -> None:
        self.path = path
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s

    def load(self) -> dict[str, dict[str, Any]]:
        """Every finished record by id (first occurrence wins); a torn last line is ignored."""
        return self._read()[0]

    def _read(self) -> tuple[dict[str, dict[str, Any]], int]:
        """The records and the length of the clean prefix (everything up to the last newline)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}, 0
        end = data.rfind(b"\n") + 1
        records: dict[str, dict[str, Any]] = {}
        for number, line in enumerate(data[:end].splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                records.setdefault(str(record["id"]), record)
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(
                    f"{self.path}:{number}: not a response record; move the file aside to regenerate"
                ) from None
        return records, end

    def writer(self) -> CheckpointWriter:
        return CheckpointWriter(self)


class CheckpointWriter:
    """The one writer of a checkpoint: takes the lock, cuts a torn tail, then appends records."""

    def __init__(self, checkpoint: ResponseCheckpoint) -> None:
        self._checkpoint = checkpoint
        self._fd = _append_fd(checkpoint.path)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise CheckpointError(f"{checkpoint.path}: another process is writing this checkpoint") from None
        try:
            self.done, end = checkpoint._read()
            if end < os.fstat(self._fd).st_size:
                os.ftruncate(self._fd, end)
        except BaseException:
            os.close(self._fd)
            raise
        self._synced_at = time.monotonic()

    def append(self, record: dict[str, Any]) -> None:
        _write_all(self._fd, _line(record))
        policy = self._checkpoint.fsync
        if policy == "always" or (
            policy == "interval" and time.monotonic() - self._synced_at >= self._checkpoint.fsync_interval_s
        ):
            os.fsync(self._fd)
            self._synced_at = time.monotonic()

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            if self._checkpoint.fsync != "never":
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class ErrorLog:
    """The per-dataset errors file: one JSON line per request that failed for good."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def append(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            self._fd = _append_fd(self.path)
        _write_all(self._fd, _line(record))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
