"""Merge + template + mask + shuffle + shard, streamed through bucket files, with the embedded
model's real tokenizer and responses tables in the form of contract C1."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.generation.prompts import parse_record
from eagle3_pipeline.testing.c1_records import generated, message, response_row, write_responses
from eagle3_pipeline.training_data import build_training_data, load_tokenizer, read_manifest, split_of

SAMPLES = Path(__file__).resolve().parents[2] / "eagle3_pipeline" / "samples"

pytestmark = pytest.mark.local_model


def qa(i: int, dataset: str, answer: str | None, finish: str = "stop") -> dict[str, Any]:
    return response_row(f"id{i:03d}", dataset, [message("user", f"Question number {i}?"), generated(answer, finish)])


def build(files: list[Path], out: Path, model: Path, **overrides: Any) -> Any:
    settings: dict[str, Any] = {"seed": 3, "eval_fraction": 0.2, "shard_rows": 16, "max_seq_len": 200, **overrides}
    return build_training_data(files, str(model), out, **settings)


def shard_rows(folder: Path) -> list[dict[str, Any]]:
    manifest = read_manifest(folder)
    return [
        row
        for split in ("train", "eval")
        for name in manifest["shards"][split]
        for row in pq.read_table(folder / name).to_pylist()
    ]


@pytest.fixture
def responses(tmp_path: Path) -> list[Path]:
    a = [qa(i, "A", f"Answer {i}.") for i in range(30)]
    a.append(qa(99, "A", "   "))
    a.append(qa(98, "A", "word " * 400, finish="length"))
    a.append(response_row("id097", "A", [message("user", "Hi"), message("assistant", "Hello")]))  # nothing generated
    b = [qa(i, "B", f"Answer {i}.") for i in range(25, 40)]
    return [write_responses(tmp_path / "A.parquet", a), write_responses(tmp_path / "B.parquet", b)]


def test_build_training_data_end_to_end(tmp_path: Path, local_model: Path, responses: list[Path]) -> None:
    stats = build(responses, tmp_path / "td1", local_model)
    assert stats.duplicates == 5 and stats.empty_responses == 1 and stats.no_generated_turn == 1
    assert stats.over_length == 1 and stats.truncated_turns == 1
    assert stats.train_rows + stats.eval_rows == 40 and stats.eval_rows > 0
    assert stats.template_mismatch == 0 and stats.template_mismatch_rate == 0.0
    assert {name: s.rows for name, s in stats.per_dataset.items()} == {"A": 30, "B": 10}
    assert stats.per_dataset["A"].masked_tokens > 0 and stats.masked_tokens == sum(
        s.masked_tokens for s in stats.per_dataset.values()
    )

    folder = tmp_path / "td1"
    manifest = read_manifest(folder)
    assert len(manifest["shards"]["train"]) == -(-stats.train_rows // 16)
    assert manifest["per_dataset"]["B"]["rows"] == 10 and manifest["template_mismatch_rate"] == 0.0
    assert len(manifest["version"]) == 16
    rows = shard_rows(folder)
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) == r["num_tokens"] <= 200 for r in rows)
    assert all(r["num_masked"] == sum(r["loss_mask"]) > 0 for r in rows)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 40
    assert all(split_of(i, 3, 0.2) == "eval" for i in ids[stats.train_rows :])
    train_shards = [pq.read_table(folder / n) for n in manifest["shards"]["train"]]
    assert [len(t) for t in train_shards[:-1]] == [16] * (len(train_shards) - 1)

    tokenizer = load_tokenizer(str(local_model))
    first = rows[0]
    masked = tokenizer.decode([t for t, m in zip(first["input_ids"], first["loss_mask"], strict=True) if m])
    assert masked == f"Answer {int(first['id'][2:])}.<|im_end|>"

    freq = pq.read_table(folder / "token_freq.parquet").to_pylist()
    train_masked = sum(r["num_masked"] for r in rows[: stats.train_rows])
    assert sum(r["count"] for r in freq) == train_masked > 0
    assert [r["count"] for r in freq] == sorted((r["count"] for r in freq), reverse=True)


def test_output_depends_on_seed_and_ids_only_not_on_input_order_or_buffer_size(
    tmp_path: Path, local_model: Path, responses: list[Path]
) -> None:
    build(responses, tmp_path / "td1", local_model)
    shuffled = []
    for path in responses:
        rows = pq.read_table(path).to_pylist()
        random.Random(7).shuffle(rows)
        shuffled.append(write_responses(tmp_path / f"shuffled-{path.name}", rows))
    build(shuffled, tmp_path / "td2", local_model, buffer_rows=3)  # many buckets, many batches
    first, second = read_manifest(tmp_path / "td1"), read_manifest(tmp_path / "td2")
    assert first["shards"] == second["shards"]
    for name in [*first["shards"]["train"], *first["shards"]["eval"], "token_freq.parquet"]:
        assert pq.read_table(tmp_path / "td1" / name).equals(pq.read_table(tmp_path / "td2" / name)), name
    assert first["version"] == second["version"]

    build(responses, tmp_path / "td3", local_model, seed=4)
    assert read_manifest(tmp_path / "td3")["version"] != first["version"]
    assert [r["id"] for r in shard_rows(tmp_path / "td3")] != [r["id"] for r in shard_rows(tmp_path / "td1")]


def _splits(folder: Path) -> dict[str, set[str]]:
    manifest = read_manifest(folder)
    return {
        split: {r["id"] for name in manifest["shards"][split] for r in pq.read_table(folder / name).to_pylist()}
        for split in ("train", "eval")
    }


def test_the_held_out_slice_is_fixed_by_seed_and_ids_forced_into_eval_and_recorded(
    tmp_path: Path, local_model: Path, responses: list[Path]
) -> None:
    stats = build(responses, tmp_path / "td1", local_model, held_out_per_dataset=4)
    manifest = read_manifest(tmp_path / "td1")
    splits = _splits(tmp_path / "td1")
    kept: dict[str, list[str]] = {}
    for row in shard_rows(tmp_path / "td1"):
        kept.setdefault(row["dataset"], []).append(row["id"])
    # per dataset the 4 kept rows with the smallest sha256("held_out:{seed}:{id}"), in that order
    smallest = {
        d: sorted(ids, key=lambda i: hashlib.sha256(f"held_out:3:{i}".encode()).digest())[:4]
        for d, ids in sorted(kept.items())
    }
    assert manifest["held_out"] == smallest and manifest["held_out_per_dataset"] == 4
    assert stats.as_metadata()["held_out_rows"] == 8 and stats.held_out == smallest
    held = {i for ids in smallest.values() for i in ids}
    assert held <= splits["eval"] and not held & splits["train"]
    assert any(split_of(i, 3, 0.2) == "train" for i in held)  # forced: the split hash alone sent some of them to train
    assert all(split_of(i, 3, 0.2) == "eval" for i in splits["eval"] - held)  # the others keep their split
    assert all(split_of(i, 3, 0.2) == "train" for i in splits["train"])
    assert stats.train_rows + stats.eval_rows == 40 and stats.eval_rows == len(splits["eval"])

    shuffled = []
    for path in responses:
        rows = pq.read_table(path).to_pylist()
        random.Random(11).shuffle(rows)
        shuffled.append(write_responses(tmp_path / f"shuffled-{path.name}", rows))
    build(shuffled, tmp_path / "td2", local_model, held_out_per_dataset=4, buffer_rows=3)  # many buckets, many batches
    again = read_manifest(tmp_path / "td2")
    assert again["held_out"] == smallest and again["version"] == manifest["version"]

    build(responses, tmp_path / "td3", local_model, seed=4, held_out_per_dataset=4)
    assert read_manifest(tmp_path / "td3")["held_out"] != smallest
    # B keeps 10 rows: at most half of them are held out, so that it still trains
    capped = build(responses, tmp_path / "td4", local_model, held_out_per_dataset=8)
    assert [len(capped.held_out[d]) for d in ("A", "B")] == [8, 5]
    assert capped.held_out["A"][:4] == smallest["A"]
    off = build(responses, tmp_path / "td5", local_model)
    assert read_manifest(tmp_path / "td5")["held_out"] == {} and off.as_metadata()["held_out_rows"] == 0


def test_template_mismatches_are_counted_per_dataset_with_examples(tmp_path: Path, local_model: Path) -> None:
    call = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]
    rows = [qa(i, "T", f"Answer {i}.") for i in range(3)]
    rows.append(
        response_row("tool1", "T", [message("user", "Look it up"), generated(None, "tool_calls", tool_calls=call)])
    )
    stats = build([write_responses(tmp_path / "T.parquet", rows)], tmp_path / "td", local_model)
    assert stats.per_dataset["T"].template_mismatch == 1 and stats.template_mismatch_rate == 0.25
    assert stats.train_rows + stats.eval_rows == 3
    assert stats.mismatch_examples == ["T/tool1: message 1: the template renders nothing of the generated turn"]


def test_a_table_from_before_generated_turns_were_marked_is_refused_by_name(tmp_path: Path, local_model: Path) -> None:
    old_messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    old = pa.table(
        {
            "id": ["old1"],
            "dataset": ["L"],
            "messages": pa.array(
                [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]], old_messages
            ),
            "tools": pa.array([None], pa.string()),
        }
    )
    pq.write_table(old, tmp_path / "L.parquet")
    with pytest.raises(
        ValueError, match=r"L.parquet: messages have no 'generated' field .* materialize responses again"
    ):
        build([tmp_path / "L.parquet"], tmp_path / "td", local_model)
    assert not (tmp_path / "td").exists()


def test_a_table_without_the_messages_column_is_named(tmp_path: Path, local_model: Path) -> None:
    pq.write_table(pa.table({"id": ["x"], "dataset": ["D"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: column\(s\) messages, tools missing"):
        build([tmp_path / "bad.parquet"], tmp_path / "td", local_model)
    assert not (tmp_path / "td").exists()


def test_manifest_lists_what_draft_vocab_and_hidden_states_read(
    tmp_path: Path, local_model: Path, responses: list[Path]
) -> None:
    build(responses, tmp_path / "td", local_model)
    manifest = json.loads((tmp_path / "td" / "manifest.json").read_text())
    assert {"version", "tokenizer", "chat_template_sha256", "seed", "shards", "vocab_size"} <= manifest.keys()
    assert manifest["vocab_size"] == 49152
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left behind


def sample_rows() -> list[dict[str, Any]]:
    """Every shipped sample prompt, answered by a generated turn made of other samples' text (a
    quarter cut by ``length``, a fifth after a regenerated earlier turn and a follow-up question)."""
    prompts = []
    for name, fmt in {"chat": "sharegpt", "code": "openai", "math": "sharegpt", "tools": "openai"}.items():
        for line in (SAMPLES / f"{name}.jsonl").read_text().splitlines():
            prompts.append((name, *parse_record(json.loads(line), fmt)))
    texts = [m[-1]["content"] for _, m, _ in prompts]
    out = []
    for i, (name, messages, tools) in enumerate(prompts):
        stored = [message(m["role"], m["content"]) for m in messages]
        if i % 5 == 0:
            stored += [generated(texts[(i * 3) % len(texts)]), message("user", "Go on, in more detail.")]
        stored.append(
            generated(" ".join(texts[(i * 7 + k) % len(texts)] for k in range(2)), "length" if i % 4 == 0 else "stop")
        )
        out.append(response_row(f"s{i:03d}", name, stored, json.loads(tools) if tools else None))
    return out


def test_emit_and_render_give_the_same_rows_on_the_embedded_model(tmp_path: Path, local_model: Path) -> None:
    """SmolLM2's template renders a response as the target emitted it (no reasoning): the default
    ``emit`` mode must not change its training data."""
    files = [write_responses(tmp_path / "S.parquet", sample_rows())]
    emitted = build(files, tmp_path / "emit", local_model, max_seq_len=8192)
    rendered = build(files, tmp_path / "render", local_model, max_seq_len=8192, reasoning="render")
    assert emitted.template_mismatch == rendered.template_mismatch == 0
    assert emitted.train_rows + emitted.eval_rows == 288 and emitted.masked_tokens == rendered.masked_tokens > 0
    first, second = read_manifest(tmp_path / "emit"), read_manifest(tmp_path / "render")
    assert first["tokenizer_kind"] == "fast" and (first["reasoning"], second["reasoning"]) == ("emit", "render")
    assert first["version"] == second["version"]
    for name in [*first["shards"]["train"], *first["shards"]["eval"], "token_freq.parquet"]:
        assert pq.read_table(tmp_path / "emit" / name).equals(pq.read_table(tmp_path / "render" / name)), name
