"""The ``train`` phase's spec: built from the pipeline file here (:func:`train_spec`, no torch: the code
location imports it) and read back where the phase runs (:func:`parse_spec`). The spec is the
``drafter:`` section it reads (:class:`TrainSettings`, the section's own model with the values the phase
resolves) plus where things are (:class:`TrainSpec`), validated by pydantic once."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError

from eagle3_pipeline.config import ComputeConfig, ConfigModel, DrafterConfig, PipelineConfig
from eagle3_pipeline.config.loader import validation_problems

DRAFT_VOCAB_DIR = "draft_vocab"
HIDDEN_STATES_DIR = "hidden_states"
DRAFTER_DIR = "drafter"
SPEC_PATHS = ("store", "draft_vocab", "target_weights", "run_dir", "export_dir")
# drafter: keys that are no training setting: where the target is (the spec's own path), and how many
# processes train (the launcher's).
NOT_SETTINGS = frozenset({"target_weights", "nproc_per_node"})


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


class TrainError(ValueError):
    """A training run that cannot start or continue; the message says why and what to do."""


class TrainSettings(DrafterConfig):
    """The ``drafter:`` section as the ``train`` phase reads it: its fields, bounds and defaults (see
    docs/settings.md), with ``seed`` and ``max_seq_len`` resolved (:meth:`from_config`) and
    ``activation_checkpointing`` chosen. In the spec (:meth:`as_spec`) ``model`` holds only the keys the
    file sets."""

    # Required here where the section allows None; pydantic lets a subclass narrow a field, pyright wants a default.
    seed: int  # pyright: ignore[reportGeneralTypeIssues]
    max_seq_len: Annotated[int, Field(gt=2)]  # pyright: ignore[reportGeneralTypeIssues]
    # auto is chosen before the spec is built (eagle3_pipeline.fit.runtime.resolved).
    activation_checkpointing: bool = False
    # No training settings, so never in the spec's settings: the target is the spec's own target_weights,
    # and the launcher counts the processes.
    target_weights: None = Field(default=None, exclude=True)
    nproc_per_node: None = Field(default=None, exclude=True)

    @classmethod
    def from_config(cls, drafter: DrafterConfig, pipeline_seed: int, target_max_seq_len: int) -> TrainSettings:
        """``drafter``'s settings; its ``seed`` and ``max_seq_len`` default to the pipeline's seed and
        ``target.max_seq_len``."""
        return cls.model_validate(
            {
                **drafter.model_dump(exclude={"model", *NOT_SETTINGS}),
                "model": drafter.model,
                "seed": pipeline_seed if drafter.seed is None else drafter.seed,
                "max_seq_len": drafter.max_seq_len or target_max_seq_len,
            }
        )

    def model_overrides(self) -> dict[str, Any]:
        """``drafter.model``'s keys the file sets: variant switches left off are left out, as keys left
        out are, so a plain drafter's spec and identity are those from before the switches."""
        return self.model.model_dump(mode="json", exclude_defaults=True)

    def as_spec(self) -> dict[str, Any]:
        """The spec's ``settings`` (JSON)."""
        return {**self.model_dump(mode="json", exclude={"model"}), "model": self.model_overrides()}

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint (bookkeeping settings excluded, the choice of
        the exported checkpoint, and activation checkpointing: it recomputes the same values, so a run
        may resume with it switched). The default loss is left out (a checkpoint written before the loss
        was a setting trained with it), and η unless the loss reads it. ``init_from`` is left out: the run's
        identity holds its content digest instead (a moved start is the same start); ``init_l2sp`` at 0
        (off) too, so a run from before the setting resumes."""
        skip = {
            "checkpoint_every",
            "keep_checkpoints",
            "eval_samples",
            "log_every",
            "export_dtype",
            "activation_checkpointing",
            "select",
            "select_steps",
            "init_from",
            *(("init_l2sp",) if not self.init_l2sp else ()),
            *(("loss",) if self.loss == "kl" else ()),
            *(("lk_eta",) if self.loss != "lk_lambda" else ()),
        }
        return {k: v for k, v in self.as_spec().items() if k not in skip}


class TrainSpec(ConfigModel):
    """The ``train`` spec (JSON): where things are, on the machine where the phase runs, and the settings."""

    store: Path
    draft_vocab: Path
    target_weights: Path
    run_dir: Path
    export_dir: Path
    settings: TrainSettings
    # The rolling segment to train ({epoch, window}), checked against the store's layout (drafter.train.epochs).
    rolling: dict[str, Any] | None = None


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
    from eagle3_pipeline.target.local_model import local_model_dir

    return str(local_model_dir())


def train_spec(config: PipelineConfig, root: Path | None = None) -> dict[str, Any]:
    """JSON-able spec for ``eagle3_pipeline.drafter.train.phase:run`` from a fitted ``config`` (no ``auto``
    left). Paths are under ``root``, the pipeline's own artifacts root by default: ``run_heavy_phase``
    maps them onto the host's."""
    settings = TrainSettings.from_config(config.drafter, config.seed, config.target.max_seq_len)
    paths = drafter_paths(root or config.artifacts_root)
    return {
        **{k: str(v) for k, v in paths.items()},
        "target_weights": target_weights(config.drafter, config.compute),
        "settings": settings.as_spec(),
    }


def parse_spec(spec: Mapping[str, Any]) -> tuple[dict[str, Path], TrainSettings]:
    """The spec's paths and settings, validated once; a missing, unknown or out-of-bounds key is refused by name."""
    try:
        parsed = TrainSpec.model_validate(spec)
    except ValidationError as exc:
        raise TrainError(f"train spec: {validation_problems(exc, spec)}") from None
    return {k: getattr(parsed, k) for k in SPEC_PATHS}, parsed.settings
