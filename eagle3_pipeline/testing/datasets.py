"""Dataset files as the tests write them: JSONL records, and ShareGPT conversations to put in them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def write_jsonl(path: Path, records: Sequence[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sharegpt(text: str, answer: str | None = None) -> dict[str, object]:
    turns = [{"from": "human", "value": text}]
    if answer is not None:
        turns.append({"from": "gpt", "value": answer})
    return {"conversations": turns}
