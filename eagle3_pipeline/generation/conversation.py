"""Conversations: which assistant turns a prompt regenerates, the checkpoint record built from its
completions, and the responses table built from the checkpoint."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from eagle3_pipeline.generation.client import Completion
from eagle3_pipeline.records import RESPONSE_SCHEMA, Message, PromptRecord, message, normalized

# The responses table: the shared response columns plus what generation adds.
RESPONSE_TABLE_SCHEMA = (
    RESPONSE_SCHEMA.append(pa.field("reasoning", pa.string()))
    .append(pa.field("cost", pa.float64()))
    .append(pa.field("turns", pa.int64()))
)

ROW_FIELDS = (
    "response",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "latency_s",
    "model",
    "endpoint",
    "finished_at",
    "reasoning",
    "cost",
)


def turns_to_regenerate(messages: Sequence[Mapping[str, Any]], mode: str) -> list[int]:
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


def generated_message(completion: Completion, keep_reasoning: bool) -> Message:
    """The assistant message as the server returned it, marked as generated (contract C1)."""
    return message(
        "assistant",
        completion.content,
        reasoning_content=completion.reasoning if keep_reasoning else None,
        tool_calls=completion.tool_calls,
        generated=True,
        finish_reason=completion.finish_reason or None,
    )


def build_record(prompt: PromptRecord, turns: Sequence[tuple[int, Completion]], keep_reasoning: bool) -> dict[str, Any]:
    """One checkpoint line for a prompt answered by ``turns`` ((message index, completion) pairs; the
    last one is the response, appended after the prompt's messages).

    Tokens, latency and cost add up over the turns; ``finish_reason`` is ``length`` if any turn was
    cut by ``max_tokens``. ``generated`` holds every generated message with its index."""
    completions = [c for _, c in turns]
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
        "generated": [{"index": index, "message": generated_message(c, keep_reasoning)} for index, c in turns],
    }
    if keep_reasoning and final.reasoning:
        record["reasoning"] = final.reasoning
    if any(c.usage_estimated for c in completions):
        record["usage_estimated"] = True
    return record


def conversation(prompt: PromptRecord, record: Mapping[str, Any]) -> list[Message]:
    """The prompt's messages with the generated ones put in place (regenerated turns replaced, the
    final answer appended), every message with all C1 fields."""
    messages = [normalized(m) for m in prompt.messages]
    for turn in record.get("generated") or []:
        index, generated = int(turn["index"]), normalized(turn["message"])
        if index < len(messages):
            messages[index] = generated
        else:
            messages.append(generated)
    return messages


def response_rows(prompts: Sequence[PromptRecord], done: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The responses table: one row per answered prompt, in prompt order; ``messages`` is the whole
    conversation with every generated assistant turn as the server returned it."""
    rows = []
    for prompt in prompts:
        record = done.get(prompt.id)
        if record is None:
            continue
        rows.append(
            {
                **{k: record.get(k) for k in ROW_FIELDS},
                "id": prompt.id,
                "dataset": prompt.dataset,
                "messages": conversation(prompt, record),
                "tools": prompt.tools,
                "turns": int(record.get("turns") or 1),
            }
        )
    return rows
