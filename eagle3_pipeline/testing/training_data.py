"""A small real `training_data` folder (contract C2) written by the tests."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_pipeline.training_data import SHARD_SCHEMA

# Short texts of a few kinds, for rows tokenized by a real tokenizer.
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Write a function that returns the square of a number.",
    "What is the capital of France? Paris is the capital.",
    "Speculative decoding drafts tokens that the target verifies.",
]


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


def two_dataset_training_data(folder: Path, vocab: int) -> Path:
    """Eight train rows of two datasets (``a`` 5, ``b`` 3) and two eval rows, up to 20 tokens each,
    ids below ``vocab``."""
    train = [
        sample_rows("a", 5, seed=11, max_len=20, vocab=vocab),
        sample_rows("b", 3, seed=12, max_len=20, vocab=vocab),
    ]
    return write_training_data(
        folder, {"train": train, "eval": [sample_rows("e", 2, seed=13, max_len=20, vocab=vocab)]}, vocab_size=vocab
    )


def tokenized_training_data(folder: Path, model_dir: Path, texts: Sequence[str] = TEXTS) -> None:
    """One row per text (its first 16 tokens, the second half masked) tokenized with the tokenizer of
    ``model_dir``: all but the last in train, the last in eval."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for number, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"][:16]
        mask = [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)
        rows.append(
            {
                "id": f"r{number}",
                "dataset": "B1",
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": len(ids),
                "num_masked": sum(mask),
            }
        )
    write_training_data(folder, {"train": [rows[:-1]], "eval": [rows[-1:]]}, vocab_size=len(tokenizer))
