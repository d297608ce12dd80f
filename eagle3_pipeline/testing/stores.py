"""Small real hidden-state stores and draft vocabularies written with the store module (C3, C4)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

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
                sample_id, dataset, split, ids, mask, torch.randn(length, 3 * HIDDEN), torch.randn(length, HIDDEN)
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
