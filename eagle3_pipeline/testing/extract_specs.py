"""``extract`` phase specs for the tests that run the phase on training data of their own: the spec's
paths and target name, small shards, and the settings a test states (the others are the pipeline
file's, through :class:`~eagle3_pipeline.hidden_states.extract_spec.ExtractSpec`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def extract_spec(data: Path, output: Path, model: Path, name: str, **settings: Any) -> dict[str, Any]:
    """Shards of 40 tokens and a spot check of 2 samples unless ``settings`` say otherwise."""
    return {
        "training_data": str(data),
        "output": str(output),
        "model": str(model),
        "target_name": name,
        "shard_tokens": 40,
        "spot_check_samples": 2,
        **settings,
    }


def transformers_spec(data: Path, output: Path, model: Path, name: str, **settings: Any) -> dict[str, Any]:
    """The transformers backend on the CPU, each sample alone."""
    return extract_spec(data, output, model, name, **{"device": "cpu", "max_batch_size": 1, **settings})
