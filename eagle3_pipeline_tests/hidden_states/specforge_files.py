"""Fixture data in SpecForge's offline format (``scripts/prepare_hidden_states.py``), written with ``torch.save``
as ``scripts/prepare_hidden_states.py`` does, plus the matching ``training_data`` shards (C2)."""

from __future__ import annotations

import gzip
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_pipeline.training_data import SHARD_SCHEMA

HIDDEN = 8
LAYERS = [1, 3, 4]
TARGET = {"name": "tiny-target", "config_sha256": "0" * 64, "num_layers": 8, "hidden_size": HIDDEN, "vocab_size": 100}


@dataclass
class Sample:
    idx: int
    sample_id: str
    dataset: str
    split: str
    input_ids: Any
    loss_mask: Any
    aux: Any
    hidden: Any


def make_samples(count: int, seed: int = 0) -> list[Sample]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for idx in range(count):
        length = int(torch.randint(5, 20, (1,), generator=generator))
        samples.append(
            Sample(
                idx=idx,
                sample_id=f"s{idx:04d}",
                dataset="B1_chat" if idx % 2 else "B3_code",
                split="eval" if idx >= count - 2 else "train",
                input_ids=torch.randint(0, 100, (length,), generator=generator),
                loss_mask=(torch.rand(length, generator=generator) > 0.3).to(torch.int64),
                aux=torch.randn(length, len(LAYERS) * HIDDEN, generator=generator, dtype=torch.float32),
                hidden=torch.randn(length, HIDDEN, generator=generator, dtype=torch.float32),
            )
        )
    return samples


def write_specforge(out: Path, samples: list[Sample], compress: bool = False) -> Path:
    """``out/rows_{g}-{g+2000}/data_{idx}.ckpt`` (or ``.ckpt.gz``), one dict per sample."""
    import torch

    for sample in samples:
        group = sample.idx // 2000 * 2000
        folder = out / f"rows_{group}-{group + 2000}"
        folder.mkdir(parents=True, exist_ok=True)
        record = {
            "input_ids": sample.input_ids,
            "loss_mask": sample.loss_mask,
            "aux_hidden_state": sample.aux[None],
            "hidden_state": sample.hidden[None],
        }
        if compress:
            buffer = io.BytesIO()
            torch.save(record, buffer)
            (folder / f"data_{sample.idx}.ckpt.gz").write_bytes(gzip.compress(buffer.getvalue()))
        else:
            torch.save(record, folder / f"data_{sample.idx}.ckpt")
    return out


def write_training_data(folder: Path, samples: list[Sample]) -> list[str]:
    """Train and eval shards with the C2 columns, rows in sample order; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    schema = SHARD_SCHEMA
    paths = []
    for split in ("train", "eval"):
        rows = [
            {
                "id": s.sample_id,
                "dataset": s.dataset,
                "input_ids": s.input_ids.tolist(),
                "loss_mask": s.loss_mask.tolist(),
                "num_tokens": len(s.input_ids),
                "num_masked": int(s.loss_mask.sum()),
            }
            for s in samples
            if s.split == split
        ]
        path = folder / f"{split}-00000.parquet"
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
        paths.append(str(path))
    return paths


def import_spec(
    input_dir: Path, output_dir: Path, training_data: list[str] | None, per_shard: int = 4
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "input_dir": str(input_dir),
        "output_dir": str(output_dir),
        "target": TARGET,
        "aux_layer_ids": LAYERS,
        "training_data_version": "td-test",
        "samples_per_shard": per_shard,
    }
    if training_data is not None:
        spec["training_data"] = training_data
    return spec
