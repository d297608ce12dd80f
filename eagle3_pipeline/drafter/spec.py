"""The ``train`` phase spec from the pipeline file (no torch here: the code location imports it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_pipeline.config import PipelineConfig

DRAFT_VOCAB_DIR = "draft_vocab"
HIDDEN_STATES_DIR = "hidden_states"
DRAFTER_DIR = "drafter"


def drafter_paths(root: Path) -> dict[str, Path]:
    """Inputs and outputs of the drafter under an artifacts root (local or on the GPU host)."""
    return {
        "store": root / HIDDEN_STATES_DIR,
        "draft_vocab": root / DRAFT_VOCAB_DIR,
        "run_dir": root / DRAFTER_DIR / "run",
        "export_dir": root / DRAFTER_DIR / "export",
    }


def train_spec(config: PipelineConfig, root: Path | None = None) -> dict[str, Any]:
    """JSON-able spec for ``eagle3_pipeline.drafter.train:run``; ``root`` is the artifacts root where
    the phase runs (default: the pipeline's own)."""
    from eagle3_pipeline.serving import local_model_dir

    drafter = config.drafter
    settings: dict[str, Any] = drafter.model_dump(exclude={"model", "target_weights", "seed", "max_seq_len"})
    settings["model"] = drafter.model.model_dump(exclude_none=True)
    settings["seed"] = config.seed if drafter.seed is None else drafter.seed
    settings["max_seq_len"] = drafter.max_seq_len or config.target.max_seq_len
    paths = drafter_paths(root or config.artifacts_root)
    return {
        **{k: str(v) for k, v in paths.items()},
        "target_weights": drafter.target_weights or str(local_model_dir()),
        "settings": settings,
    }
