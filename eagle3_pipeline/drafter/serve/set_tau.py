"""τ per prompt set and category on a running speculative server, loops apart, thinking and answer apart.

Each (set, category) is sent as its own batch at ``concurrency``, greedy: first turns, then (MT-Bench) second
turns built from the target's own first answers. τ comes from the engine, as the benchmark's arms read it:

- SGLang: per request from ``meta_info`` (τ = Σ completion_tokens / Σ spec_verify_ct over the category's
  requests), so a loop-flagged request is simply left out of τ and reported apart; a request without
  ``spec_verify_ct`` (no verify step) is counted apart too.
- vLLM: its ``/metrics`` counters are global, so each batch is bracketed by counter snapshots (nothing else may
  use the server meanwhile); τ = 1 + Δaccepted / Δdrafts, per position Δaccepted_pos / Δdrafts. The
  loop-flagged requests of a category are re-sent alone as one more bracketed batch (greedy: the same
  completions) and subtracted: τ with and without them are both reported.

Thinking vs answer (``think_markers`` set, for a reasoning target): over the first-turn requests whose completion
has thinking and an answer, the answer is measured alone (prompt + thinking re-sent as the prompt,
:mod:`eagle3_pipeline.drafter.serve.completion_checks`) and the thinking is the whole less the answer; for vLLM the
whole is re-measured as one bracketed batch of those requests.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from eagle3_pipeline.config import BenchmarkPromptSetsConfig
from eagle3_pipeline.drafter.serve.completion_checks import (
    PartAcceptance,
    split_thinking,
    tail_loop,
    thinking_answer,
)
from eagle3_pipeline.drafter.serve.prompt_sets import BenchPrompt, PromptSetError, first_turn, load_sets, second_turn
from eagle3_pipeline.target.folder import load_tokenizer

LOOP_TAIL_CHARS = 80  # the end of a flagged completion's text, kept with its flag for a person to read


@dataclass(frozen=True)
class Completion:
    """One answered request: its token ids and text, and SGLang's verify steps (None from vLLM)."""

    token_ids: tuple[int, ...]
    text: str
    verify_steps: int | None


class Counters(Protocol):
    """vLLM's speculative counters at one scrape (the online benchmark's ``SpecCounters``)."""

    @property
    def accepted(self) -> float: ...

    @property
    def drafts(self) -> float: ...

    @property
    def per_position(self) -> tuple[float, ...]: ...


class Engine(Protocol):
    """A running speculative server: ``server`` is sglang or vllm; ``counters`` scrapes vLLM's /metrics."""

    server: str

    def generate(self, prompt: Sequence[int], max_tokens: int) -> Completion: ...

    def counters(self) -> Counters: ...


@dataclass
class _Tally:
    tokens: float = 0.0  # completion tokens that verify steps produced (vLLM: drafts + accepted)
    steps: float = 0.0
    per_position: list[float] = field(default_factory=list)

    def add(self, tokens: float, steps: float, per_position: Sequence[float] = ()) -> None:
        self.tokens += tokens
        self.steps += steps
        if per_position:
            old = self.per_position or [0.0] * len(per_position)
            self.per_position = [a + b for a, b in zip(old, per_position, strict=False)]

    @property
    def tau(self) -> float | None:
        return round(self.tokens / self.steps, 4) if self.steps > 0 else None


@dataclass(frozen=True)
class CategoryTau:
    """One (set, category): τ without the loop-flagged requests, with them, and who was flagged."""

    set: str
    category: str
    requests: int
    completion_tokens: int
    tau: float | None
    tau_with_loops: float | None
    acceptance_per_position: list[float] | None
    loop_flagged: list[dict[str, Any]]
    no_verify_requests: int = 0


@dataclass(frozen=True)
class SetSettings:
    """How the sets are sent: tokens per request, concurrency, the loop flag's thresholds, the think markers."""

    max_tokens: int
    concurrency: int
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    loop_min_tail: int = 32
    loop_max_period: int = 16
    think_markers: tuple[str, str] | None = None


def _bracketed(engine: Engine, send: Callable[[], list[Completion]]) -> tuple[list[Completion], Counters | None]:
    """``send()``'s answers, and for vLLM the counters' increase around it."""
    before = engine.counters() if engine.server == "vllm" else None
    answers = send()
    if before is None:
        return answers, None
    after = engine.counters()
    positions = after.per_position if len(after.per_position) == len(before.per_position) else ()
    return answers, _Delta(
        after.accepted - before.accepted,
        after.drafts - before.drafts,
        tuple(a - b for a, b in zip(positions, before.per_position, strict=False)),
    )


@dataclass(frozen=True)
class _Delta:
    accepted: float
    drafts: float
    per_position: tuple[float, ...]


def _batch(
    engine: Engine, prompts: Sequence[Sequence[int]], settings: SetSettings, limits: Sequence[int] = ()
) -> list[Completion]:
    """The prompts sent at the settings' concurrency, each up to its ``limits`` entry (default max_tokens)."""
    tokens = list(limits) or [settings.max_tokens] * len(prompts)
    with ThreadPoolExecutor(max_workers=max(1, settings.concurrency)) as pool:
        return list(pool.map(lambda job: engine.generate(*job), zip(prompts, tokens, strict=True)))


def _add_vllm(tally: _Tally, delta: Counters | None, sign: float = 1.0) -> None:
    if delta is not None:
        tally.add(sign * (delta.drafts + delta.accepted), sign * delta.drafts, [sign * p for p in delta.per_position])


def measure_category(
    engine: Engine, prompts: Sequence[BenchPrompt], tokenizer: Any, settings: SetSettings
) -> tuple[CategoryTau, list[tuple[list[int], Completion]]]:
    """One category's τ (module doc), and its first turns' (prompt ids, completion) for the thinking split."""
    firsts = [first_turn(p, tokenizer, settings.chat_template_kwargs) for p in prompts]
    answers, delta = _bracketed(engine, lambda: _batch(engine, firsts, settings))
    requests = [(p, 1, ids, a) for p, ids, a in zip(prompts, firsts, answers, strict=True)]
    follow = [
        (p, second_turn(p, a.text, tokenizer, settings.chat_template_kwargs))
        for p, a in zip(prompts, answers, strict=True)
    ]
    follow_ids = [(p, ids) for p, ids in follow if ids is not None]
    deltas = [delta]
    if follow_ids:
        seconds, delta2 = _bracketed(engine, lambda: _batch(engine, [ids for _, ids in follow_ids], settings))
        requests += [(p, 2, ids, a) for (p, ids), a in zip(follow_ids, seconds, strict=True)]
        deltas.append(delta2)
    flagged, clean, all_requests = [], _Tally(), _Tally()
    no_verify = 0
    looped: list[list[int]] = []
    for prompt, turn, ids, answer in requests:
        loop = tail_loop(answer.token_ids, settings.loop_min_tail, settings.loop_max_period)
        if loop is not None:
            flagged.append(
                {
                    "id": prompt.id,
                    "turn": turn,
                    "period": loop.period,
                    "repeated": loop.repeated_tokens,
                    "tail": answer.text[-LOOP_TAIL_CHARS:],
                }
            )
            looped.append(ids)
        if engine.server == "sglang":
            if not answer.verify_steps:
                no_verify += 1
                continue
            all_requests.add(len(answer.token_ids), answer.verify_steps)
            if loop is None:
                clean.add(len(answer.token_ids), answer.verify_steps)
    if engine.server == "vllm":
        for d in deltas:
            _add_vllm(all_requests, d)
            _add_vllm(clean, d)
        if looped:
            _, loop_delta = _bracketed(engine, lambda: _batch(engine, looped, settings))
            _add_vllm(clean, loop_delta, -1.0)
    per_position = [round(a / clean.steps, 4) for a in clean.per_position] if clean.steps > 0 else None
    figures = CategoryTau(
        prompts[0].set,
        prompts[0].category,
        len(requests),
        sum(len(a.token_ids) for *_, a in requests),
        clean.tau,
        all_requests.tau,
        per_position or None,
        flagged,
        no_verify,
    )
    return figures, [(ids, a) for p, turn, ids, a in requests if turn == 1]


def _marker_ids(tokenizer: Any, marker: str) -> list[int]:
    return list(tokenizer(marker, add_special_tokens=False)["input_ids"])


def measure_thinking(
    engine: Engine, firsts: Sequence[tuple[list[int], Completion]], tokenizer: Any, settings: SetSettings
) -> dict[str, Any] | None:
    """Thinking and answer τ over the requests whose completion has both (module doc); None when none has."""
    if settings.think_markers is None:
        return None
    start, end = (_marker_ids(tokenizer, m) for m in settings.think_markers)
    split = []
    for prompt, answer in firsts:
        cut = split_thinking(prompt, answer.token_ids, start, end)
        if cut is not None and 0 < cut < len(answer.token_ids):
            split.append((prompt, answer, cut))
    if not split:
        return None
    alone = [[*prompt, *answer.token_ids[:cut]] for prompt, answer, cut in split]
    limits = [len(answer.token_ids) - cut for _, answer, cut in split]
    answers, answer_delta = _bracketed(engine, lambda: _batch(engine, alone, settings, limits))
    if engine.server == "sglang":
        whole = (sum(len(a.token_ids) for _, a, _ in split), sum(a.verify_steps or 0 for _, a, _ in split))
        answer_part = (sum(len(a.token_ids) for a in answers), sum(a.verify_steps or 0 for a in answers))
    else:
        _, whole_delta = _bracketed(engine, lambda: _batch(engine, [p for p, _, _ in split], settings))
        whole_tally, answer_tally = _Tally(), _Tally()
        _add_vllm(whole_tally, whole_delta)
        _add_vllm(answer_tally, answer_delta)
        whole = (int(whole_tally.tokens), int(whole_tally.steps))
        answer_part = (int(answer_tally.tokens), int(answer_tally.steps))
    thinking, answer = thinking_answer(*whole, *answer_part)
    return {"requests": len(split), "thinking": _part(thinking), "answer": _part(answer)}


def _part(part: PartAcceptance) -> dict[str, Any]:
    return {"tokens": part.tokens, "verify_steps": part.verify_steps, "tau": round(part.tau or 0.0, 4) or None}


def measure_sets(
    engine: Engine, prompts: Sequence[BenchPrompt], tokenizer: Any, settings: SetSettings
) -> dict[str, Any]:
    """Every (set, category) of ``prompts`` in first-seen order, then the thinking/answer split: the figures
    the benchmark's result and metadata carry (``categories``, ``loop_flagged``, ``thinking``)."""
    groups: dict[tuple[str, str], list[BenchPrompt]] = {}
    for prompt in prompts:
        groups.setdefault((prompt.set, prompt.category), []).append(prompt)
    categories, firsts = [], []
    for group in groups.values():
        figures, first = measure_category(engine, group, tokenizer, settings)
        categories.append(figures)
        firsts += first
    flagged = [{"set": c.set, "category": c.category, **f} for c in categories for f in c.loop_flagged]
    return {
        "categories": categories,
        "loop_flagged": flagged,
        "thinking": measure_thinking(engine, firsts, tokenizer, settings),
    }


@dataclass(frozen=True)
class PromptSetRun:
    """What the benchmark's speculative arm measures after its timed run: the prompts, the target's tokenizer
    (to render public sets' turns) and how they are sent."""

    prompts: Sequence[BenchPrompt]
    tokenizer: Any
    settings: SetSettings


def prompt_set_run(
    config: BenchmarkPromptSetsConfig, training_data: Path, max_tokens: int, concurrency: int, trust_remote_code: bool
) -> PromptSetRun | None:
    """The configured sets (None when none is), rendered with the tokenizer and ``chat_template_kwargs`` that
    training_data recorded in its manifest (the target's, as generation applied them); ``trust_remote_code`` is
    ``target.trust_remote_code``."""
    if not config.sets:
        return None
    prompts = load_sets(config.sets, training_data, config.per_category, config.held_out_per_dataset)
    manifest_path = training_data / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        tokenizer_name = str(manifest["tokenizer"])
    except (OSError, ValueError, KeyError) as exc:
        raise PromptSetError(
            f"{manifest_path}: expected training_data's manifest naming its tokenizer ({exc})"
        ) from None
    tokenizer = load_tokenizer(tokenizer_name, trust_remote_code)
    settings = SetSettings(
        max_tokens,
        concurrency,
        dict(manifest.get("chat_template_kwargs") or {}),
        config.loop_min_tail,
        config.loop_max_period,
        config.think_markers,
    )
    return PromptSetRun(prompts, tokenizer, settings)


def prompt_set_metadata(figures: dict[str, Any] | None) -> dict[str, Any]:
    """``tau_sets``: one row per (set, category) with τ without and with the loop-flagged requests;
    ``loop_flagged`` and ``thinking`` as measured (empty when no set was measured)."""
    if figures is None:
        return {}
    rows = [
        {k: c[k] for k in ("set", "category", "requests", "completion_tokens", "tau", "tau_with_loops")}
        | {"loops": len(c["loop_flagged"])}
        for c in figures["categories"]
    ]
    return {"tau_sets": rows, "loop_flagged": figures["loop_flagged"], "thinking": figures["thinking"]}
