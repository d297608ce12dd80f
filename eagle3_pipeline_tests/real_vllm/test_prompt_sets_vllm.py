"""A loop-prone prompt flagged on a real vLLM (CPU build) serving the embedded model: under greedy decoding the
tiny target answers "Write a poem where every line is 'the sky is blue'." with a short block ("A fleeting sight,
a fleeting sight,") repeated to the end,
while a plain question ends normally. One server for the module, the target alone (no drafter: the flag reads the
completion's token ids, which the target decides; τ per category is then None, no verify step having run)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_pipeline.drafter.serve.benchmark import measure_prompt_sets
from eagle3_pipeline.drafter.serve.prompt_sets import BenchPrompt
from eagle3_pipeline.drafter.serve.set_tau import SetSettings
from eagle3_pipeline.target.folder import load_tokenizer
from eagle3_pipeline.testing.real_vllm import RunningVllm, vllm_server

pytestmark = [pytest.mark.local_model, pytest.mark.timeout(900)]
LOOP_PRONE = "Write a poem where every line is 'the sky is blue'."
PLAIN = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def target(
    real_vllm_python: Path, local_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningVllm]:
    with vllm_server(local_model, tmp_path_factory.mktemp("vllm") / "server.log") as server:
        yield server


def test_a_loop_prone_prompt_is_flagged_and_a_plain_one_is_not(target: RunningVllm, local_model: Path) -> None:
    prompts = [
        BenchPrompt("probe", "chat", "plain", turns=(PLAIN,)),
        BenchPrompt("probe", "chat", "loop", turns=(LOOP_PRONE,)),
    ]
    settings = SetSettings(max_tokens=96, concurrency=2)
    tokenizer = load_tokenizer(str(local_model))
    figures = measure_prompt_sets(
        "vllm", target.root_url, prompts=prompts, tokenizer=tokenizer, settings=settings, timeout_s=300.0
    )
    (category,) = figures["categories"]
    assert category["requests"] == 2 and category["tau"] is None
    (flag,) = figures["loop_flagged"]
    print(f"loop-flagged: {flag}")
    assert (flag["id"], flag["turn"]) == ("loop", 1)
    assert flag["repeated"] >= 32 and flag["period"] <= 16
    tail = flag["tail"]
    assert tail[-16:] in tail[:-16]  # the text's end repeats too (here "A fleeting sight, a fleeting sight,")
