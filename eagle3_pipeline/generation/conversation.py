"""Conversations: which assistant turns a prompt regenerates, the checkpoint record built from its
completions, and the responses table built from the checkpoint."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from eagle3_pipeline.generation.client import Completion
from eagle3_pipeline.records import RESPONSE_SCHEMA, PromptRecord

# The responses table: the shared response columns plus what generation adds.
RESPONSE_TABLE_SCHEMA = (
    RESPONSE_SCHEMA.append(pa.field("reasoning", pa.string()))
    .append(pa.field("cost", pa.float64()))
    .append(pa.field("turns", pa.int64()))
)

ROW_FIELDS = (
    "response", "finish_reason", "prompt_tokens", "completion_tokens", "latency_s", "model", "endpoint", "finished_at", "reasoning", "cost"
)


def turns_to_regenerate(messages: Sequence[Mapping[str, str]], mode: str) -> list[int]:
    """Indices of the earlier assistant turns to regenerate before the final one (mode ``all``).

    An assistant turn answered by a ``tool`` message is kept as it is: the tool result that follows
    belongs to that exact call."""
    if mode != "all":
        return []
    return [
        i
        for i, message in enumerate(messages)
        if message["role"] == "assistant" and not (i + 1 < len(messages) and messages[i + 1]["role"] == "tool")
    ]


def build_record(
    prompt: PromptRecord, completions: Sequence[Completion], history: list[dict[str, str]] | None, keep_reasoning: bool
) -> dict[str, Any]:
    """One checkpoint line for a prompt answered by ``completions`` (the last one is the response).

    Tokens, latency and cost add up over the turns; ``finish_reason`` is ``length`` if any turn was
    cut by ``max_tokens``. ``history`` is the regenerated conversation, when turns were regenerated."""
    final = completions[-1]
    costs = [c.cost for c in completions if c.cost is not None]
    record: dict[str, Any] = {
        "id": prompt.id,
        "dataset": prompt.dataset,
        "response": final.text,
        "finish_reason": "length" if any(c.finish_reason == "length" for c in completions) else final.finish_reason,
        "prompt_tokens": sum(c.prompt_tokens for c in completions),
        "completion_tokens": sum(c.completion_tokens for c in completions),
        "latency_s": round(sum(c.latency_s for c in completions), 4),
        "model": final.model,
        "endpoint": final.endpoint,
        "cost": sum(costs) if costs else None,
        "turns": len(completions),
        "finished_at": time.time(),
    }
    if keep_reasoning and final.reasoning:
        record["reasoning"] = final.reasoning
    if any(c.usage_estimated for c in completions):
        record["usage_estimated"] = True
    if history is not None:
        record["history"] = history
    return record


def response_rows(prompts: Sequence[PromptRecord], done: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The responses table: one row per answered prompt, in prompt order; ``messages`` is the
    conversation (regenerated where turns were) followed by the generated assistant turn."""
    rows = []
    for prompt in prompts:
        record = done.get(prompt.id)
        if record is None:
            continue
        history = record.get("history") or prompt.messages
        rows.append(
            {
                **{k: record.get(k) for k in ROW_FIELDS},
                "id": prompt.id,
                "dataset": prompt.dataset,
                "messages": [*history, {"role": "assistant", "content": record.get("response") or ""}],
                "tools": prompt.tools,
                "turns": int(record.get("turns") or 1),
            }
        )
    return rows
