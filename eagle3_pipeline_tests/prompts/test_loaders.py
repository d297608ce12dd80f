"""Loaders and normalization over real files in every supported format."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.config import DatasetConfig, PromptsConfig, load_config, local_profile_path
from eagle3_pipeline.generation.prompts import PromptSourceError, load_prompts
from eagle3_pipeline.records import message, wire_message
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl

SETTINGS = PromptsConfig(long_threshold_tokens=50)


def load(path: Path, fmt: str = "auto", sample_size: int | None = None, seed: int = 0):
    ds = DatasetConfig.model_validate({"id": "B1", "source": str(path), "format": fmt, "sample_size": sample_size})
    return load_prompts(ds, SETTINGS, seed)


def test_sharegpt_jsonl_normalizes_roles_and_cuts_trailing_answer(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [sharegpt("What is 2+2?", "4")])
    records, stats = load(path, "sharegpt")
    assert stats.kept == 1
    assert records[0].messages == [message("user", "What is 2+2?")]
    assert records[0].dataset == "B1" and records[0].length_class == "short"


def test_openai_with_tools_and_text_parts(tmp_path: Path) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
        ],
        "tools": [tool],
    }
    records, _ = load(write_jsonl(tmp_path / "d.jsonl", [record]), "openai")
    assert records[0].messages[1] == message("user", "Weather in Oslo?")
    assert records[0].tool_schemas() == [tool]


def test_openai_tool_calls_and_tool_results_are_kept(tmp_path: Path) -> None:
    """Contract C1: an assistant turn that only called tools keeps content None and its calls as
    JSON text; the tool message keeps its tool_call_id and name."""
    call = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    record = {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": call},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "12 C"},
            {"role": "user", "content": "And tomorrow?"},
        ]
    }
    [prompt], _ = load(write_jsonl(tmp_path / "d.jsonl", [record]), "openai")
    assistant, tool = prompt.messages[1], prompt.messages[2]
    assert assistant == message("assistant", None, tool_calls=json.dumps(call))
    assert json.loads(assistant["tool_calls"]) == call
    assert tool == message("tool", "12 C", tool_call_id="call_1", name="get_weather")
    assert wire_message(assistant) == {"role": "assistant", "content": None, "tool_calls": call}
    with_strings, _ = load(
        write_jsonl(
            tmp_path / "s.jsonl",
            [
                {
                    **record,
                    "messages": [
                        record["messages"][0],
                        {"role": "assistant", "tool_calls": json.dumps(call)},
                        *record["messages"][2:],
                    ],
                }
            ],
        ),
        "openai",
    )
    assert with_strings[0].messages[1]["tool_calls"] == json.dumps(call), "tool_calls given as JSON text are read too"


def test_ids_are_stable_content_hashes(tmp_path: Path) -> None:
    a, _ = load(write_jsonl(tmp_path / "a.jsonl", [sharegpt("same"), sharegpt("other")]))
    b, _ = load(write_jsonl(tmp_path / "b.jsonl", [sharegpt("other"), sharegpt("same")]))
    assert {r.id for r in a} == {r.id for r in b}
    assert len({r.id for r in a}) == 2


def test_empty_and_duplicate_prompts_are_dropped_and_counted(tmp_path: Path) -> None:
    rows = [sharegpt("hello"), sharegpt("hello"), sharegpt("   "), sharegpt("world")]
    records, stats = load(write_jsonl(tmp_path / "d.jsonl", rows))
    assert [r.messages[-1]["content"] for r in records] == ["hello", "world"]
    assert (stats.duplicates, stats.empty, stats.kept) == (1, 1, 2)


def test_malformed_records_are_skipped_with_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps(sharegpt("good one"))
        + "\n"
        + "{not json\n"
        + json.dumps({"conversations": [{"from": "alien", "value": "x"}]})
        + "\n"
        + json.dumps({"conversations": [{"from": "gpt", "value": "no user"}]})
        + "\n"
        + json.dumps(sharegpt("good two"))
        + "\n"
    )
    records, stats = load(path)
    assert len(records) == 2 and stats.malformed == 3
    assert stats.malformed_examples[0].startswith("line 2: invalid JSON")
    assert "line 3" in stats.malformed_examples[1] and "'alien'" in stats.malformed_examples[1]
    assert "line 4: conversation has no user turn" in stats.malformed_examples[2]


def test_a_file_with_no_usable_record_fails_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "wrong schema"}\n{"text": "again"}\n')
    with pytest.raises(PromptSourceError, match=r"d\.jsonl: none of the 2 records is usable.*line 1"):
        load(path)


def test_unreadable_json_file_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text('[\n{"conversations": []},\n oops\n]')
    with pytest.raises(PromptSourceError, match=r"d\.json:3: invalid JSON"):
        load(path)


def test_json_list_and_parquet_sources(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3)]
    (tmp_path / "d.json").write_text(json.dumps({"data": rows}))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    from_json, _ = load(tmp_path / "d.json")
    from_parquet, _ = load(tmp_path / "d.parquet")
    assert [r.id for r in from_json] == [r.id for r in from_parquet] and len(from_json) == 3


def test_corrupt_parquet_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(PromptSourceError, match=r"d\.parquet: not a readable Parquet file"):
        load(path)


def test_length_class_uses_threshold(tmp_path: Path) -> None:
    records, _ = load(write_jsonl(tmp_path / "d.jsonl", [sharegpt("short"), sharegpt("word " * 200)]))
    assert [r.length_class for r in records] == ["short", "long"]


def test_sampling_is_deterministic_and_seeded(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [sharegpt(f"prompt {i}") for i in range(50)])
    first, stats = load(path, sample_size=10, seed=7)
    again, _ = load(path, sample_size=10, seed=7)
    other, _ = load(path, sample_size=10, seed=8)
    assert [r.id for r in first] == [r.id for r in again]
    assert [r.id for r in first] != [r.id for r in other]
    assert stats.sampled_out == 40 and stats.kept == 10


def test_ten_percent_more_records_keeps_the_sample_and_its_answers(tmp_path: Path) -> None:
    """sample_size keeps the smallest sha256(seed:id): growing the source by 10 % changes the sample
    only by the new records that sort under the cut and the old ones they push over it. The answers
    of the kept prompts are matched by id, so none is sent again; those of the pushed-out prompts stay
    in the checkpoint (not lost) and return if the sample grows back."""
    size, base = 200, 2000
    path = write_jsonl(tmp_path / "d.jsonl", [sharegpt(f"prompt {i}") for i in range(base)])
    before, _ = load(path, sample_size=size, seed=3)
    grown = write_jsonl(tmp_path / "g.jsonl", [sharegpt(f"prompt {i}") for i in range(base + base // 10)])
    after, stats = load(grown, sample_size=size, seed=3)
    old, new = {r.id for r in before}, {r.id for r in after}
    kept = len(old & new) / len(old)
    pushed_out = old - new
    newcomers = new - old
    all_new_records = {r.id for r in load(grown)[0]} - {r.id for r in load(path)[0]}
    print(
        f"\nsample {size} of {base} -> of {base + base // 10} records: kept {len(old & new)}/{len(old)} = {kept:.1%}, "
        f"{len(newcomers)} newcomers (all among the {len(all_new_records)} new records), {len(pushed_out)} pushed out "
        f"(their answers stay in the checkpoint), 0 kept prompts need a new answer"
    )
    assert kept >= 0.9
    assert newcomers <= all_new_records, "only new records enter the sample"
    assert len(pushed_out) == len(newcomers), "each newcomer pushes out exactly one old prompt"
    assert stats.kept == size and len(after) == size


def test_shipped_sample_sets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(local_profile_path())
    assert len(config.datasets) >= 4
    multi_turn = 0
    for ds in config.datasets:
        full = ds.model_copy(update={"sample_size": None})
        records, stats = load_prompts(full, config.prompts, config.seed)
        assert stats.malformed == 0 and stats.duplicates == 0, ds.id
        assert len(records) >= 60, ds.id
        assert {r.length_class for r in records} == {"short", "long"}, ds.id
        multi_turn += sum(any(m["role"] == "assistant" for m in r.messages) for r in records)
        if ds.id == "B2_tools":
            assert all(r.tools for r in records)
    assert multi_turn >= 20
