"""Stable sampling end to end: a source that grows by 10 % keeps >= 90 % of its sample, and a rerun
against a loopback server reuses every finished answer of the prompts that stayed — it only sends the
newcomers — while the answers of the prompts pushed out stay in the checkpoint."""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.config import DatasetConfig, PromptsConfig
from eagle3_pipeline.generation import ResponseCheckpoint, response_rows
from eagle3_pipeline.generation.prompts import load_prompts
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline.testing.generation_runs import run, settings


def sample(path: Path, size: int) -> list:
    records, _ = load_prompts(DatasetConfig(id="B1", source=str(path), sample_size=size), PromptsConfig(), seed=11)
    return records


def test_growing_the_source_by_ten_percent_reuses_the_finished_answers(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    base, size = 600, 60
    first = sample(write_jsonl(tmp_path / "a.jsonl", [sharegpt(f"prompt {i}") for i in range(base)]), size)
    run(tmp_path, first, fake_openai, settings(concurrency=8))
    sent_first = len(fake_openai.requests)

    grown = sample(write_jsonl(tmp_path / "b.jsonl", [sharegpt(f"prompt {i}") for i in range(base + base // 10)]), size)
    summary = run(tmp_path, grown, fake_openai, settings(concurrency=8))
    old, new = {p.id for p in first}, {p.id for p in grown}
    kept = old & new
    rows = response_rows(grown, ResponseCheckpoint(tmp_path / "ck.jsonl").load())
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl").load()
    print(
        f"\n{base} -> {base + base // 10} records, sample {size}: kept {len(kept)}/{size} ({len(kept) / size:.1%}); "
        f"rerun reused {summary.already_done} answers, sent {len(fake_openai.requests) - sent_first} (the newcomers: "
        f"{len(new - old)}); {len(old - new)} pushed-out answers still in the checkpoint"
    )
    assert len(kept) / size >= 0.9
    assert (
        summary.already_done == len(kept)
        and summary.generated == len(new - old) == len(fake_openai.requests) - sent_first
    )
    assert len(rows) == size, "every prompt of the new sample has its answer"
    assert old - new <= set(checkpoint), "the answers of the prompts pushed out are kept, not lost"
