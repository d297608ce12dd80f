"""Texts, a foreign tokenizer and where a test keeps the serving reference, for the tests of the
serving reference and of the validation against the serving target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower and its museums, and "
    "many people visit it every year.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints the sum of two numbers",
    "Water boils at one hundred degrees Celsius at sea level, and it freezes at zero degrees.",
    "Once upon a time there was a little girl who lived in a village near the forest with her grandmother.",
]


def reference_of(data: Path) -> Path:
    """Where a test keeps the reference of ``data`` (the pipeline: <artifacts_root>/serving_reference.json)."""
    return data.parent / "serving_reference.json"


def other_tokenizer(local_model: Path, folder: Path) -> Any:
    """A tokenizer other than the served one: SmolLM2's with only its first 10000 BPE merges (as an
    older or foreign tokenizer would split the same text into other ids)."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True)
    spec = json.loads((local_model / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:10000]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text((local_model / "tokenizer_config.json").read_text())
    return AutoTokenizer.from_pretrained(str(folder))
