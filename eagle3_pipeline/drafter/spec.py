"""The ``train`` phase spec from the pipeline file (no torch here: the code location imports it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_pipeline.config import ComputeConfig, DrafterConfig, PipelineConfig

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


class DrafterSpecError(ValueError):
    """The pipeline file does not say enough to build the ``train`` spec; the message names the key."""


def target_weights(drafter: DrafterConfig, compute: ComputeConfig) -> str:
    """The target model folder the drafter reads its embedding and lm_head from: `drafter.target_weights`,
    else the embedded model's folder. On a GPU host (`compute.kind` ssh or command) the phase reads
    it there, so the key is then required and names the folder on the host."""
    if drafter.target_weights:
        return drafter.target_weights
    if compute.kind != "local":
        raise DrafterSpecError(
            f"drafter.target_weights: required with compute.kind {compute.kind!r}: the target model's folder "
            "(config.json + safetensors) on the GPU host; the embedded model's folder is a path on this machine"
        )
    from eagle3_pipeline.serving import local_model_dir

    return str(local_model_dir())


def train_spec(config: PipelineConfig, root: Path | None = None) -> dict[str, Any]:
    """JSON-able spec for ``eagle3_pipeline.drafter.train:run``. Paths are under ``root``, the
    pipeline's own artifacts root by default: ``run_heavy_phase`` maps them onto the host's."""
    drafter = config.drafter
    settings: dict[str, Any] = drafter.model_dump(
        exclude={"model", "target_weights", "seed", "max_seq_len", "nproc_per_node"}
    )
    settings["model"] = drafter.model.model_dump(exclude_none=True)
    settings["seed"] = config.seed if drafter.seed is None else drafter.seed
    settings["max_seq_len"] = drafter.max_seq_len or config.target.max_seq_len
    paths = drafter_paths(root or config.artifacts_root)
    return {
        **{k: str(v) for k, v in paths.items()},
        "target_weights": target_weights(drafter, config.compute),
        "settings": settings,
    }
