"""The one builder of pipeline files for tests (a helper module, not a test): a permissive base (floors any
machine meets, one dataset whose source it writes, outputs and the tokenizer folder under the test's folder)
with a test's sections deep-merged over it, so each test states only the settings it exercises."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import PipelineConfig, load_config
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl

# Floors every test machine meets: the health checks' defaults (5 GB of disk, 1 GB of RAM) fail on a full CI runner.
PERMISSIVE_HEALTH: dict[str, Any] = {"min_disk_free_gb": 0.01, "min_mem_free_gb": 0.01}
# The tiny real target, found by name where the `local_model` fixture installs it; its own tokenizer.
TINY_TARGET: dict[str, Any] = {"name": "t", "target": {"model": "SmolLM2-135M-Instruct", "tokenizer": None}}


def merged(base: Mapping[str, Any], *overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with each override laid over it in turn: mappings merge key by key at any depth, any other value
    (a list, a scalar, None) replaces what was there."""
    result = dict(base)
    for override in overrides:
        for key, value in override.items():
            if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
                result[key] = merged(result[key], value)
            else:
                result[key] = value
    return result


def write_sources(folder: Path, *names: str, questions: int = 3) -> list[dict[str, Any]]:
    """A ShareGPT source ``<name>.jsonl`` of ``questions`` prompts per dataset, and the ``datasets`` section
    that names them."""
    for name in names:
        write_jsonl(folder / f"{name}.jsonl", [sharegpt(f"{name} question {i}") for i in range(questions)])
    return [{"id": name, "source": f"{name}.jsonl"} for name in names]


def write_pipeline(folder: Path, *overrides: Mapping[str, Any], file_name: str = "pipeline.yaml") -> Path:
    """``folder/file_name`` with ``overrides`` deep-merged over the permissive base; where no override sets
    ``datasets``, the base's dataset B1 gets a one-prompt source unless ``B1.jsonl`` already exists."""
    folder.mkdir(parents=True, exist_ok=True)
    base: dict[str, Any] = {
        "name": "test",
        "artifacts_root": str(folder / "out"),
        "target": {"model": "target", "tokenizer": str(folder)},
        "health": PERMISSIVE_HEALTH,
        "datasets": [{"id": "B1", "source": "B1.jsonl"}],
    }
    if not any("datasets" in override for override in overrides) and not (folder / "B1.jsonl").exists():
        write_sources(folder, "B1", questions=1)
    path = folder / file_name
    path.write_text(json.dumps(merged(base, *overrides), indent=1))
    return path


def load_pipeline(folder: Path, *overrides: Mapping[str, Any], runtime_checks: bool = False) -> PipelineConfig:
    """:func:`write_pipeline`, loaded as the code location loads it (``runtime_checks``: as a run loads it, the
    sources and API-key variables checked too)."""
    return load_config(write_pipeline(folder, *overrides), runtime_checks=runtime_checks)
