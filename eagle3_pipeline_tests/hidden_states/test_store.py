"""The hidden-state store: round trip, torn-shard detection, NaN rejection, vocab invariants."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.hidden_states.store import (
    HiddenStateStore,
    ShardWriter,
    StoreError,
    StoreManifest,
    TargetIdentity,
    bytes_per_token,
    default_aux_layer_ids,
    identity_mismatch,
    load_draft_vocab,
    save_draft_vocab,
)
from eagle3_pipeline.testing.stores import random_states_sample

H = 8


def test_round_trip_keeps_every_sample_in_order(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path, 0)
    originals = {f"s{i}": random_states_sample(5 + i, i) for i in range(3)}
    for sid, sample in originals.items():
        writer.add(sid, "B1", split="train", **sample)
    writer.close()
    store = HiddenStateStore(tmp_path)
    assert store.shard_complete("shard-00000")
    store.write_index(["shard-00000"])
    read = list(store.iter_samples(split="train"))
    assert [s.sample_id for s in read] == list(originals)
    for sample in read:
        original = originals[sample.sample_id]
        assert torch.equal(sample.input_ids, original["input_ids"])
        assert torch.equal(sample.loss_mask, original["loss_mask"].bool())
        assert torch.equal(sample.aux_hidden_states, original["aux"].to(torch.bfloat16))
        assert torch.equal(sample.hidden_states, original["hidden"].to(torch.bfloat16))


def test_a_torn_shard_is_not_complete(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path, 0)
    writer.add("s0", "B1", split="train", **random_states_sample(6, 0))
    writer.close()
    (tmp_path / "shard-00000.index.parquet").unlink()
    assert not HiddenStateStore(tmp_path).shard_complete("shard-00000")
    writer = ShardWriter(tmp_path, 1)
    writer.add("s1", "B1", split="train", **random_states_sample(6, 1))
    writer.close()
    tensors = tmp_path / "shard-00001.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-10])
    assert not HiddenStateStore(tmp_path).shard_complete("shard-00001")


def test_nan_states_are_rejected_with_the_sample_named(tmp_path: Path) -> None:
    sample = random_states_sample(4, 0)
    sample["aux"][2, 3] = float("nan")
    with pytest.raises(StoreError, match="s-bad: aux_hidden_states holds NaN"):
        ShardWriter(tmp_path, 0).add("s-bad", "B1", split="train", **sample)


def test_manifest_identity_names_each_difference(tmp_path: Path) -> None:
    target = TargetIdentity("tiny", "abc", 30, 576, 49152)
    made = StoreManifest(target, default_aux_layer_ids(30), "v1")
    assert made.aux_layer_ids == [1, 14, 26]
    store = HiddenStateStore(tmp_path)
    store.write_manifest(made)
    wanted = StoreManifest(target, [2, 15, 27], "v2")
    problems = identity_mismatch(store.manifest(), wanted)
    assert problems == [
        "aux_layer_ids: store has [1, 14, 26], expected [2, 15, 27]",
        "training_data_version: store has 'v1', expected 'v2'",
    ]
    assert bytes_per_token(576) == 4 * 576 * 2 + 5


def test_draft_vocab_round_trip_and_invariants(tmp_path: Path) -> None:
    used = torch.tensor([0, 3, 4, 9])
    d2t = used - torch.arange(4)
    t2d = torch.zeros(12, dtype=torch.bool)
    t2d[used] = True
    save_draft_vocab(tmp_path, d2t, t2d, {"draft_vocab_size": 4})
    loaded_d2t, loaded_t2d, manifest = load_draft_vocab(tmp_path)
    assert torch.equal(loaded_d2t, d2t) and torch.equal(loaded_t2d, t2d) and manifest["draft_vocab_size"] == 4
    t2d[5] = True
    save_draft_vocab(tmp_path, d2t, t2d, {})
    with pytest.raises(StoreError, match="d2t and t2d disagree"):
        load_draft_vocab(tmp_path)
