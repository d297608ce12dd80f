"""τ per prompt set and category from SGLang's per-request meta_info, with a looping request left out of τ and
reported apart, and the benchmark's metadata of it. SGLang's engine is the stand-in (``FakeSglang``: its native
``/generate`` with ``output_ids`` and ``spec_verify_ct``; a prompt holding its ``loop_token`` answers that token
repeated, at a higher acceptance, as a degenerate loop does)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_pipeline.drafter.serve.benchmark import measure_prompt_sets
from eagle3_pipeline.drafter.serve.completion_checks import THINK_END, THINK_START
from eagle3_pipeline.drafter.serve.prompt_sets import BenchPrompt
from eagle3_pipeline.drafter.serve.set_tau import SetSettings, prompt_set_metadata
from eagle3_pipeline.target.folder import load_tokenizer
from eagle3_pipeline.testing.fake_sglang import FakeSglang

pytestmark = pytest.mark.usefixtures("process_table")
LOOP_TOKEN = 7


@pytest.fixture
def sglang(tmp_path: Path) -> Iterator[FakeSglang]:
    server = FakeSglang(tmp_path / "sglang", tp_size=1)
    server.set(loop_token=LOOP_TOKEN, accept_length=2.0, loop_accept_length=4.0)
    server.start(args=["--speculative-num-steps", "3"])
    yield server
    server.stop()


def test_a_looping_request_is_flagged_and_left_out_of_its_categorys_tau(sglang: FakeSglang) -> None:
    prompts = [
        BenchPrompt("held_out", "chat", "c1", (1, 2, 3)),
        BenchPrompt("held_out", "chat", "c2", (4, 5, LOOP_TOKEN)),
        BenchPrompt("held_out", "chat", "c3", (6,)),
        BenchPrompt("held_out", "code", "k1", (8, 9)),
    ]
    settings = SetSettings(max_tokens=40, concurrency=2)
    figures = measure_prompt_sets(
        "sglang", sglang.base_url, prompts=prompts, tokenizer=None, settings=settings, timeout_s=30.0
    )
    chat, code = figures["categories"]
    assert (chat["set"], chat["category"], chat["requests"], chat["completion_tokens"]) == ("held_out", "chat", 3, 120)
    assert chat["tau"] == 2.0  # 80 tokens in 40 verify steps: the looping request (4.0) is left out
    assert chat["tau_with_loops"] == 2.4  # 120 tokens in 50 steps with it
    flag = {"id": "c2", "turn": 1, "period": 1, "repeated": 40, "tail": "x" * 40}
    assert chat["loop_flagged"] == [flag]
    assert code["tau"] == code["tau_with_loops"] == 2.0 and code["loop_flagged"] == []
    assert figures["loop_flagged"] == [{"set": "held_out", "category": "chat", **flag}]
    assert figures["thinking"] is None  # no completion has thinking
    metadata = prompt_set_metadata(figures)
    assert metadata["tau_sets"][0] == {
        "set": "held_out",
        "category": "chat",
        "requests": 3,
        "completion_tokens": 120,
        "tau": 2.0,
        "tau_with_loops": 2.4,
        "loops": 1,
    }
    assert prompt_set_metadata(None) == {}


def test_thinking_and_answer_acceptance_are_reported_apart(tmp_path: Path, kimi_checkpoint: Path) -> None:
    """The thinking/answer split over the stand-in's reasoning completions (a stand-in, not Kimi's output): 11
    thinking tokens (the end marker included) at 3 a step, then 29 answer tokens at 2 a step; the answer is
    measured alone, re-sent after the thinking, and the thinking is the rest."""
    tokenizer = load_tokenizer(str(kimi_checkpoint), trust_remote_code=True)
    start, end = (tokenizer(m, add_special_tokens=False)["input_ids"][0] for m in (THINK_START, THINK_END))
    server = FakeSglang(tmp_path / "sglang", tp_size=1)
    server.set(think_end_token=end, think_tokens=10, think_accept_length=3.0, accept_length=2.0)
    server.start(args=["--speculative-num-steps", "3"])
    try:
        prompts = [BenchPrompt("held_out", "chat", f"r{i}", (1, 2, start)) for i in range(2)]
        settings = SetSettings(max_tokens=40, concurrency=2, think_markers=(THINK_START, THINK_END))
        figures = measure_prompt_sets(
            "sglang", server.base_url, prompts=prompts, tokenizer=tokenizer, settings=settings, timeout_s=30.0
        )
    finally:
        server.stop()
    # per request: thinking ceil(11/3) = 4 steps, answer ceil(29/2) = 15 steps
    assert figures["thinking"] == {
        "requests": 2,
        "thinking": {"tokens": 22, "verify_steps": 8, "tau": 2.75},
        "answer": {"tokens": 58, "verify_steps": 30, "tau": round(58 / 30, 4)},
    }
    print(f"thinking/answer split: {figures['thinking']}")
