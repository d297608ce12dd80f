"""Tokenize + mask + merge + shuffle + shard with the embedded model's real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.dataprep import build_training_data, generated_turns, load_tokenizer, split_of, tokenize_conversation
from eagle3_pipeline.records import RESPONSE_SCHEMA, write_parquet

pytestmark = pytest.mark.local_model


@pytest.fixture(scope="module")
def tokenizer(local_model: Path):
    return load_tokenizer(str(local_model))


def masked_text(tokenizer, ids: list[int], mask: list[int]) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])


def test_mask_covers_exactly_the_generated_turn(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Eleven is prime."},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages, None, {3})
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert masked_text(tokenizer, ids, mask).strip() == "Eleven is prime.<|im_end|>"
    assert tokenizer.decode(ids).startswith("<|im_start|>system")


def test_prior_assistant_turns_can_be_masked_too(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye!"},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages, None, {1, 3})
    text = masked_text(tokenizer, ids, mask)
    assert "Hello!" in text and "Goodbye!" in text and "Bye<" not in text and "Hi" not in text


def test_regenerated_turns_are_trained_on_and_kept_ones_are_not() -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "regenerated"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "calls a tool"},
        {"role": "tool", "content": "result"},
        {"role": "assistant", "content": "final"},
    ]
    assert generated_turns(messages, turns=1, every_assistant_turn=False) == {5}
    assert generated_turns(messages, turns=2, every_assistant_turn=False) == {1, 5}
    assert generated_turns(messages, turns=1, every_assistant_turn=True) == {1, 3, 5}


def response_row(i: int, dataset: str, answer: str, finish: str = "stop") -> dict:
    messages = [{"role": "user", "content": f"Question number {i}?"}, {"role": "assistant", "content": answer}]
    return {
        "id": f"id{i:03d}", "dataset": dataset, "messages": messages, "tools": None, "response": answer,
        "finish_reason": finish, "prompt_tokens": 10, "completion_tokens": 5, "latency_s": 0.1,
        "model": "m", "endpoint": "e", "finished_at": 0.0,
    }


def test_build_training_data_end_to_end(tmp_path: Path, local_model: Path) -> None:
    a = [response_row(i, "A", f"Answer {i}.") for i in range(30)]
    a.append(response_row(99, "A", "   "))
    a.append(response_row(98, "A", "word " * 400, finish="length"))
    b = [response_row(i, "B", f"Answer {i}.") for i in range(25, 40)]
    write_parquet(a, RESPONSE_SCHEMA, tmp_path / "A.parquet")
    write_parquet(b, RESPONSE_SCHEMA, tmp_path / "B.parquet")

    def build(out: Path):
        return build_training_data(
            [tmp_path / "A.parquet", tmp_path / "B.parquet"], str(local_model), out,
            seed=3, eval_fraction=0.2, shard_rows=16, max_seq_len=200,
        )

    stats = build(tmp_path / "td1")
    assert stats.duplicates == 5 and stats.empty_responses == 1
    assert stats.over_length == 1 and stats.truncated_responses == 1
    assert stats.train_rows + stats.eval_rows == 40 and stats.eval_rows > 0
    assert dict(stats.per_dataset) == {"A": 30, "B": 10}

    manifest = json.loads((tmp_path / "td1" / "manifest.json").read_text())
    train = pq.read_table([tmp_path / "td1" / n for n in manifest["shards"]["train"]][0]).to_pylist()
    assert len(manifest["shards"]["train"]) == -(-stats.train_rows // 16)
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) == r["num_tokens"] <= 200 for r in train)
    all_ids = [
        row["id"] for split in ("train", "eval") for name in manifest["shards"][split]
        for row in pq.read_table(tmp_path / "td1" / name).to_pylist()
    ]
    assert len(all_ids) == len(set(all_ids)) == 40
    assert all(split_of(i, 3, 0.2) == "eval" for i in all_ids[stats.train_rows:])

    freq = pq.read_table(tmp_path / "td1" / "token_freq.parquet").to_pylist()
    assert sum(r["count"] for r in freq) == stats.masked_tokens > 0

    build(tmp_path / "td2")
    for name in [*manifest["shards"]["train"], *manifest["shards"]["eval"], "token_freq.parquet"]:
        assert pq.read_table(tmp_path / "td1" / name).equals(pq.read_table(tmp_path / "td2" / name))
