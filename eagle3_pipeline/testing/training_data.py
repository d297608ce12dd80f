"""A small real `training_data` folder (contract C2) written by the tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_pipeline.dataprep import SHARD_SCHEMA


def sample_rows(
    prefix: str, count: int, seed: int, min_len: int = 6, max_len: int = 24, vocab: int = 49152
) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        length = rng.randint(min_len, max_len)
        ids = [rng.randrange(vocab) for _ in range(length)]
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        rows.append(
            {
                "id": f"{prefix}{i:03d}",
                "dataset": "B1",
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": length,
                "num_masked": sum(mask),
            }
        )
    return rows


def write_training_data(
    folder: Path, splits: dict[str, list[list[dict]]], vocab_size: int = 49152, **manifest: object
) -> Path:
    """``splits``: split → shards → rows; writes the shards and a manifest listing them."""
    folder.mkdir(parents=True, exist_ok=True)
    names: dict[str, list[str]] = {"train": [], "eval": []}
    for split, shards in splits.items():
        for number, rows in enumerate(shards):
            name = f"{split}-{number:05d}.parquet"
            pq.write_table(pa.Table.from_pylist(rows, schema=SHARD_SCHEMA), folder / name)
            names[split].append(name)
    (folder / "manifest.json").write_text(json.dumps({"shards": names, "vocab_size": vocab_size, **manifest}))
    return folder
