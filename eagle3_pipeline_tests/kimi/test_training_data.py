"""training_data and the prompt-length estimate on the Kimi-K2.5 stand-in: a slow remote-code
tokenizer, loaded with ``trust_remote_code``, its chat template's kwargs passed to every render."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.generation.length import check_lengths
from eagle3_pipeline.records import PromptRecord, content_id, wire_message
from eagle3_pipeline.target.folder import TargetError, load_tokenizer
from eagle3_pipeline.testing.c1_records import generated, message, response_row, write_responses
from eagle3_pipeline.training_data import build_training_data, read_manifest

SETTINGS: dict[str, Any] = {"seed": 3, "eval_fraction": 0.0, "shard_rows": 64, "max_seq_len": 4096}


def rows(n: int, reasoning: bool = True) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        answer = generated(f"Answer {i}.", reasoning_content=f"Thinking about {i}." if reasoning else None)
        out.append(response_row(f"id{i:03d}", "K", [message("user", f"Question number {i}?"), answer]))
    cut = generated("Counting: one, two", "length", reasoning_content="Count slowly." if reasoning else None)
    out.append(response_row("cut", "K", [message("user", "Count to ten."), cut]))
    return out


def shard_rows(folder: Path) -> dict[str, dict[str, Any]]:
    manifest = read_manifest(folder)
    return {r["id"]: r for name in manifest["shards"]["train"] for r in pq.read_table(folder / name).to_pylist()}


def masked_text(tokenizer: Any, row: dict[str, Any]) -> str:
    return str(tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]))


def test_training_data_on_the_slow_kimi_tokenizer_trains_on_what_the_target_emitted(
    tmp_path: Path, kimi_checkpoint: Path
) -> None:
    files = [write_responses(tmp_path / "K.parquet", rows(6))]
    stats = build_training_data(files, str(kimi_checkpoint), tmp_path / "td", trust_remote_code=True, **SETTINGS)
    assert stats.template_mismatch == 0 and stats.train_rows == 7
    manifest = read_manifest(tmp_path / "td")
    assert manifest["tokenizer_kind"] == "slow" and manifest["reasoning"] == "emit"
    assert manifest["chat_template_kwargs"] == {} and manifest["thinking_markup"] == ["<think>", "</think>"]
    tokenizer = load_tokenizer(str(kimi_checkpoint), trust_remote_code=True)
    built = shard_rows(tmp_path / "td")
    assert masked_text(tokenizer, built["id004"]) == "Thinking about 4.</think>Answer 4.<|im_end|>"
    assert masked_text(tokenizer, built["cut"]) == "Count slowly.</think>Counting: one, two"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Question number 4?"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert built["id004"]["input_ids"][: len(prompt_ids)] == prompt_ids and not any(
        built["id004"]["loss_mask"][: len(prompt_ids)]
    )


def test_thinking_off_is_passed_to_the_template_and_reasoning_then_cannot_be_placed(
    tmp_path: Path, kimi_checkpoint: Path
) -> None:
    off = {"thinking": False}
    files = [write_responses(tmp_path / "plain.parquet", rows(3, reasoning=False))]
    build_training_data(
        files, str(kimi_checkpoint), tmp_path / "td", trust_remote_code=True, chat_template_kwargs=off, **SETTINGS
    )
    assert read_manifest(tmp_path / "td")["chat_template_kwargs"] == off
    tokenizer = load_tokenizer(str(kimi_checkpoint), trust_remote_code=True)
    row = shard_rows(tmp_path / "td")["id001"]
    assert masked_text(tokenizer, row) == "Answer 1.<|im_end|>"
    assert tokenizer.decode(row["input_ids"]).endswith("<|im_middle|><think></think>Answer 1.<|im_end|>")

    thoughtful = [write_responses(tmp_path / "thoughtful.parquet", rows(3))]
    stats = build_training_data(
        thoughtful, str(kimi_checkpoint), tmp_path / "td2", trust_remote_code=True, chat_template_kwargs=off, **SETTINGS
    )
    assert stats.template_mismatch == 4 and stats.train_rows == 0
    assert stats.mismatch_examples[0].startswith(
        "K/id000: message 1: the turn has reasoning, but the chat template renders neither"
    )


def test_a_remote_code_tokenizer_needs_trust_remote_code(tmp_path: Path, kimi_checkpoint: Path) -> None:
    files = [write_responses(tmp_path / "K.parquet", rows(1))]
    with pytest.raises(
        TargetError, match=r"target.tokenizer .*ships its own code .*set target.trust_remote_code: true"
    ):
        build_training_data(files, str(kimi_checkpoint), tmp_path / "td", **SETTINGS)
    assert not (tmp_path / "td").exists()


def test_slow_tokenization_across_a_span_edge_is_counted_as_a_mismatch(tmp_path: Path, kimi_checkpoint: Path) -> None:
    """A template that writes the answer right after a space: rendered whole (``render``), the space
    and the answer's first word are one token, which no mask can split; ``emit`` tokenizes the prompt
    on its own, as the server did, and trains on the whole answer."""
    folder = tmp_path / "spaced"
    folder.mkdir()
    for name in ("tiktoken.model", "tokenization_kimi.py", "tool_declaration_ts.py"):
        shutil.copyfile(kimi_checkpoint / name, folder / name)
    template = (
        "{%- for m in messages -%}{{- m.role + ': ' + m.content + '<|im_end|>' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}"
    )
    config = json.loads((kimi_checkpoint / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (folder / "chat_template.jinja").write_text(template)
    tokenizer = load_tokenizer(str(folder), trust_remote_code=True)
    assert len(tokenizer.encode(" the", add_special_tokens=False)) == 1
    answers = [response_row("the", "K", [message("user", "Which article?"), generated("the one")])]
    files = [write_responses(tmp_path / "K.parquet", answers)]

    stats = build_training_data(
        files, str(folder), tmp_path / "render", trust_remote_code=True, reasoning="render", **SETTINGS
    )
    assert stats.template_mismatch == 1 and stats.train_rows == 0
    edge = "user: Which article?<|im_end|>assistant: the one<|im_end|>".index("the one")
    assert stats.mismatch_examples == [
        f"K/the: the tokenizer joins the text on both sides of character {edge} into one token "
        "('>assistant: ' | 'the one<|im_'), so no token boundary lies at the edge of a trained span"
    ]
    stats = build_training_data(files, str(folder), tmp_path / "emit", trust_remote_code=True, **SETTINGS)
    assert stats.template_mismatch == 0
    assert masked_text(tokenizer, shard_rows(tmp_path / "emit")["the"]) == "the one<|im_end|>"


def prompt(text: str) -> PromptRecord:
    messages = [message("user", text)]
    return PromptRecord(content_id(messages, None), "K", messages, None, "short", len(text) // 4, 0)


def test_prompt_lengths_with_the_slow_kimi_tokenizer(kimi_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(str(kimi_checkpoint), trust_remote_code=True)
    prompts = [prompt("Name a prime."), prompt("Count the words in this sentence, please. " * 40)]

    def tokens(record: PromptRecord, **kwargs: Any) -> int:
        wire = [wire_message(m) for m in record.messages]
        rendered = tokenizer.apply_chat_template(wire, tokenize=False, add_generation_prompt=True, **kwargs)
        return len(tokenizer.encode(rendered, add_special_tokens=False))

    short, long = tokens(prompts[0]), tokens(prompts[1])
    budget = 16
    fit = check_lengths(
        prompts,
        short + budget,
        max_tokens=budget,
        estimator="tokenizer",
        tokenizer_name=str(kimi_checkpoint),
        trust_remote_code=True,
    )
    assert fit.estimator == f"tokenizer:{kimi_checkpoint}" and fit.fallbacks == 0
    assert fit.fits == prompts[:1] and fit.over_length == prompts[1:] and fit.longest == long
    # Thinking off: the generation prompt ends with <think></think>, one token more.
    off = check_lengths(
        prompts,
        short + budget,
        max_tokens=budget,
        estimator="tokenizer",
        tokenizer_name=str(kimi_checkpoint),
        trust_remote_code=True,
        chat_template_kwargs={"thinking": False},
    )
    assert off.longest == long + 1 == tokens(prompts[1], thinking=False) and off.over_length == prompts
    with pytest.raises(ValueError, match=r"set target.trust_remote_code: true.*generation.length_estimator: chars"):
        check_lengths(prompts, 4096, max_tokens=budget, estimator="tokenizer", tokenizer_name=str(kimi_checkpoint))
