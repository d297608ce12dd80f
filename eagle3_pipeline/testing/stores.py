"""Small real hidden-state stores and draft vocabularies written with the store module (C3, C4), and
the comparisons of two stores the tests make."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_pipeline.hidden_states.store import (
    HiddenStateStore,
    ShardWriter,
    StoreManifest,
    TargetIdentity,
    save_draft_vocab,
)

if TYPE_CHECKING:
    import torch

HIDDEN = 8
VOCAB = 32
PERIOD = [5, 6, 7, 8]  # responses repeat this, so the bigram drafter learns it exactly


def periodic_sample(length: int, prompt: Sequence[int] = (1, 2, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    response = [PERIOD[i % len(PERIOD)] for i in range(length)]
    ids = torch.tensor([*prompt, *response])
    mask = torch.tensor([0] * len(prompt) + [1] * length)
    return ids, mask


def noisy_sample(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.tensor([1, 2, 3]), torch.randint(10, VOCAB, (length,), generator=generator)])
    return ids, torch.tensor([0, 0, 0] + [1] * length)


def random_states_sample(length: int, seed: int, hidden: int = HIDDEN) -> dict[str, torch.Tensor]:
    """One sample as :meth:`ShardWriter.add`'s keyword arguments: random ids below 100, the second half
    masked, random aux [length, 3·hidden] and final [length, hidden] states."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 100, (length,), generator=g),
        "loss_mask": (torch.arange(length) >= length // 2).to(torch.uint8),
        "aux": torch.randn(length, 3 * hidden, generator=g),
        "hidden": torch.randn(length, hidden, generator=g),
    }


def write_store(
    root: Path, samples: Sequence[tuple[str, str, str, torch.Tensor, torch.Tensor]], shard_rows: int = 3
) -> HiddenStateStore:
    """``samples``: (sample_id, dataset, split, input_ids, loss_mask); aux/hidden states are random."""
    import torch

    store = HiddenStateStore(root)
    names = []
    for number in range(0, len(samples), shard_rows):
        writer = ShardWriter(root, number // shard_rows)
        for sample_id, dataset, split, ids, mask in samples[number : number + shard_rows]:
            length = ids.shape[0]
            writer.add(
                sample_id,
                dataset,
                split=split,
                input_ids=ids,
                loss_mask=mask,
                aux=torch.randn(length, 3 * HIDDEN),
                hidden=torch.randn(length, HIDDEN),
            )
        writer.close()
        names.append(writer.name)
    table = store.write_index(names)
    manifest = StoreManifest(
        target=TargetIdentity(name="tiny", config_sha256="0" * 64, num_layers=8, hidden_size=HIDDEN, vocab_size=VOCAB),
        aux_layer_ids=[1, 3, 4],
        training_data_version="test",
        shards=names,
        samples=table.num_rows,
        tokens=sum(table.column("length").to_pylist()),
    )
    store.write_manifest(manifest)
    return store


def write_vocab(folder: Path, used: Sequence[int]) -> Path:
    import torch

    ids = torch.tensor(sorted(used))
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    save_draft_vocab(
        folder, ids - torch.arange(ids.shape[0]), t2d, {"draft_vocab_size": len(used), "target_vocab_size": VOCAB}
    )
    return folder


def split_safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's header (parsed) and its tensor bytes. The header is compared parsed: the
    safetensors writer orders the ``__metadata__`` keys as its hash map iterates, which varies between
    calls (two saves of the same tensors in one process can differ in those bytes only)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def assert_same_store(found: Path, expected: Path) -> dict[str, int]:
    """The same shards (tensor bytes identical, headers equal), byte-identical shard indexes and
    index, the same manifest identity. Returns what was compared."""
    names = sorted(p.name for p in expected.glob("shard-*"))
    assert sorted(p.name for p in found.glob("shard-*")) == names
    compared = {"shards": 0, "tensor_bytes": 0, "index_bytes": 0}
    for name in names:
        if name.endswith(".safetensors"):
            (header, data), (reference_header, reference_data) = (
                split_safetensors(found / name),
                split_safetensors(expected / name),
            )
            assert header == reference_header, name
            assert data == reference_data, f"{name}: tensor bytes differ"
            compared["shards"] += 1
            compared["tensor_bytes"] += len(data)
        else:
            assert (found / name).read_bytes() == (expected / name).read_bytes(), name
            compared["index_bytes"] += (found / name).stat().st_size
    assert (found / "index.parquet").read_bytes() == (expected / "index.parquet").read_bytes()
    compared["index_bytes"] += (found / "index.parquet").stat().st_size
    assert HiddenStateStore(found).manifest().identity() == HiddenStateStore(expected).manifest().identity()
    return compared


def shard_contents(folder: Path) -> dict[str, object]:
    """Per shard: each tensor's dtype, shape and raw bytes, the header metadata, and the index file's
    bytes. (Whole safetensors files are not compared: the writer orders the header's metadata keys
    differently from run to run, even for the same writer and tensors.)"""
    import torch
    from safetensors import safe_open

    contents: dict[str, object] = {}
    for path in sorted(folder.glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors = {}
            for key in sorted(handle.keys()):
                tensor = handle.get_tensor(key)
                tensors[key] = (
                    str(tensor.dtype),
                    tuple(tensor.shape),
                    tensor.contiguous().view(torch.uint8).numpy().tobytes(),
                )
            contents[path.name] = (tensors, handle.metadata())
        index = path.with_name(path.name.replace(".safetensors", ".index.parquet"))
        contents[index.name] = index.read_bytes()
    return contents
