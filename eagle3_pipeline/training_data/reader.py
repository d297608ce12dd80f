"""`training_data` as the EAGLE-3 phases read it: its manifest, its version, its shards, row by row.

Only the columns of contract C2 are read (``id``, ``dataset``, ``input_ids``, ``loss_mask``,
``num_tokens``), one record batch at a time, so memory is bounded by a batch, not by the data.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

SPLITS = ("train", "eval")
READ_BATCH_ROWS = 256


class TrainingDataError(ValueError):
    """`training_data` is missing or not in the shape contract C2 describes."""


@dataclass(frozen=True)
class TrainingData:
    folder: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, folder: Path) -> TrainingData:
        path = Path(folder) / "manifest.json"
        if not path.is_file():
            raise TrainingDataError(f"{path}: no training_data manifest; materialize training_data first")
        try:
            manifest = json.loads(path.read_text())
        except ValueError as exc:
            raise TrainingDataError(f"{path}: not JSON ({exc})") from None
        shards = manifest.get("shards")
        if not isinstance(shards, dict) or not all(isinstance(shards.get(s), list) for s in SPLITS):
            raise TrainingDataError(f"{path}: shards: expected {{train: [...], eval: [...]}}, got {shards!r}")
        return cls(Path(folder), manifest)

    def shard_files(self, split: str) -> list[Path]:
        return [self.folder / name for name in self.manifest["shards"][split]]

    @property
    def vocab_size(self) -> int:
        value = self.manifest.get("vocab_size")
        if not isinstance(value, int) or value <= 0:
            raise TrainingDataError(
                f"{self.folder / 'manifest.json'}: vocab_size: expected a positive integer, got {value!r}"
            )
        return value

    def version(self) -> str:
        """The ``training_data`` version (C2): the manifest's ``version`` when the training_data phase writes one,
        else a SHA-256 over the shard files' names and bytes, in manifest order."""
        declared = self.manifest.get("version")
        if isinstance(declared, str) and declared:
            return declared
        digest = hashlib.sha256()
        for split in SPLITS:
            for path in self.shard_files(split):
                digest.update(f"{split}/{path.name}\0".encode())
                with path.open("rb") as handle:
                    for block in iter(lambda: handle.read(1 << 20), b""):
                        digest.update(block)
        return "sha256:" + digest.hexdigest()


def read_column(path: Path, column: str) -> list[Any]:
    try:
        return pq.read_table(path, columns=[column]).column(column).to_pylist()
    except (OSError, KeyError) as exc:
        raise TrainingDataError(f"{path}: cannot read column {column!r} ({type(exc).__name__}: {exc})") from None


def iter_rows(path: Path, columns: list[str], start: int = 0) -> Iterator[dict[str, Any]]:
    """The rows of one shard from row ``start`` on, a record batch at a time."""
    try:
        handle = pq.ParquetFile(path)
        row = 0
        for batch in handle.iter_batches(batch_size=READ_BATCH_ROWS, columns=columns):
            if row + batch.num_rows <= start:
                row += batch.num_rows
                continue
            yield from batch.slice(max(start - row, 0)).to_pylist()
            row += batch.num_rows
    except (OSError, KeyError) as exc:
        raise TrainingDataError(f"{path}: cannot read columns {columns} ({type(exc).__name__}: {exc})") from None
