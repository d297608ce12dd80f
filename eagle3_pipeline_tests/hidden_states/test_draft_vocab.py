"""The draft vocabulary from real training_data shards: choice, order, mapping, coverage, version."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.hidden_states.draft_vocab import build_draft_vocab, default_draft_vocab_size
from eagle3_pipeline.hidden_states.store import load_draft_vocab
from eagle3_pipeline.testing.training_data import write_training_data
from eagle3_pipeline.training_data.reader import TrainingData, TrainingDataError


def row(sample_id: str, ids: list[int], mask: list[int]) -> dict:
    return {
        "id": sample_id,
        "dataset": "B1",
        "input_ids": ids,
        "loss_mask": mask,
        "num_tokens": len(ids),
        "num_masked": sum(mask),
    }


def test_default_size_is_a_quarter_of_the_vocab_with_a_floor() -> None:
    assert default_draft_vocab_size(49152) == 12288  # the embedded model
    assert default_draft_vocab_size(128256) == 32064  # Llama 3: the published drafters use 32000
    assert default_draft_vocab_size(163840) == 40960  # Kimi-class
    assert default_draft_vocab_size(3000) == 1024
    assert default_draft_vocab_size(500) == 500


def test_most_frequent_masked_train_ids_sorted_with_coverage(tmp_path: Path) -> None:
    train = [
        row("a", [9, 9, 9, 7, 7, 5, 3], [0, 1, 1, 1, 1, 1, 1]),  # masked: 9×2, 7×2, 5, 3
        row("b", [5, 5, 2, 1, 0], [1, 1, 1, 0, 0]),  # masked: 5×2, 2; unmasked 1 and 0 never count
    ]
    evals = [row("c", [9, 11, 11], [1, 1, 1])]  # eval tokens are not counted, only covered
    data = write_training_data(tmp_path / "td", {"train": [train], "eval": [evals]}, vocab_size=12)
    result = build_draft_vocab(data, tmp_path / "dv", size=3, target_vocab_size=None)
    d2t, t2d, manifest = load_draft_vocab(tmp_path / "dv")
    # masked train counts: 5→3, 7→2, 9→2, 2→1, 3→1; the top 3 cover 7 of the 9 masked tokens.
    assert (d2t + torch.arange(3)).tolist() == [5, 7, 9]
    assert t2d.shape == (12,) and t2d.nonzero().flatten().tolist() == [5, 7, 9]
    assert manifest["coverage"] == pytest.approx(7 / 9) and result.coverage == pytest.approx(7 / 9)
    assert manifest["eval_coverage"] == pytest.approx(1 / 3)
    assert manifest["draft_vocab_size"] == 3 and manifest["target_vocab_size"] == 12
    assert manifest["training_data_version"] == TrainingData.open(data).version()


def test_ties_go_to_the_lower_id_and_unused_low_ids_pad(tmp_path: Path) -> None:
    train = [row("a", [8, 6, 4], [1, 1, 1])]
    data = write_training_data(tmp_path / "td", {"train": [train], "eval": [[]]}, vocab_size=10)
    build_draft_vocab(data, tmp_path / "two", size=2, target_vocab_size=None)
    assert (load_draft_vocab(tmp_path / "two")[0] + torch.arange(2)).tolist() == [4, 6]
    build_draft_vocab(data, tmp_path / "five", size=5, target_vocab_size=None)
    d2t, _, manifest = load_draft_vocab(tmp_path / "five")
    assert (d2t + torch.arange(5)).tolist() == [0, 1, 4, 6, 8] and manifest["coverage"] == 1.0


def test_an_id_outside_the_target_vocab_is_an_error_naming_the_shard(tmp_path: Path) -> None:
    data = write_training_data(tmp_path / "td", {"train": [[row("a", [3, 40], [1, 1])]], "eval": [[]]}, vocab_size=10)
    with pytest.raises(
        TrainingDataError, match=r"train-00000\.parquet: token id 40 is outside the target vocabulary of 10"
    ):
        build_draft_vocab(data, tmp_path / "dv", size=2, target_vocab_size=None)
    with pytest.raises(ValueError, match="draft_vocab.size: expected 1..64"):
        build_draft_vocab(data, tmp_path / "dv", size=65, target_vocab_size=64)


def test_version_is_the_manifest_one_else_a_content_hash(tmp_path: Path) -> None:
    shards = {"train": [[row("a", [1, 2], [1, 1])]], "eval": [[]]}
    hashed = TrainingData.open(write_training_data(tmp_path / "a", shards)).version()
    assert (
        hashed.startswith("sha256:")
        and hashed == TrainingData.open(write_training_data(tmp_path / "b", shards)).version()
    )
    changed = {"train": [[row("a", [1, 3], [1, 1])]], "eval": [[]]}
    assert TrainingData.open(write_training_data(tmp_path / "c", changed)).version() != hashed
    assert TrainingData.open(write_training_data(tmp_path / "d", shards, version="v7")).version() == "v7"
