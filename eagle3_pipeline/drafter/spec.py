"""The ``train`` phase's spec: built from the pipeline file here (:func:`train_spec`, no torch: the code
location imports it) and read back where the phase runs (:func:`parse_spec`). Its settings are one
typed record, :class:`TrainSettings`, made only from the validated ``drafter:`` section."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import ComputeConfig, DrafterConfig, PipelineConfig

DRAFT_VOCAB_DIR = "draft_vocab"
HIDDEN_STATES_DIR = "hidden_states"
DRAFTER_DIR = "drafter"
SPEC_PATHS = ("store", "draft_vocab", "target_weights", "run_dir", "export_dir")
# drafter: keys that are no training setting: where the target is, and how many processes train.
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


@dataclass(frozen=True)
class TrainSettings:
    """The ``drafter:`` section's training settings (see its fields in docs/settings.md). No defaults of
    its own: every value comes from the validated file (:meth:`from_config`)."""

    ttt_steps: int
    lr: float
    weight_decay: float
    warmup_ratio: float
    epochs: int
    max_steps: int | None
    batch_tokens: int
    max_seq_len: int
    grad_clip: float
    checkpoint_every: int
    keep_checkpoints: int
    eval_samples: int
    log_every: int
    seed: int
    dtype: str
    export_dtype: str
    embedding_key: str | None
    lm_head_key: str | None
    activation_checkpointing: bool
    loss: str
    lk_eta: float
    select: str
    select_steps: int
    init_from: str | None
    init_l2sp: float
    model: dict[str, Any]  # drafter.model: the keys the file sets (DrafterModelConfig)

    @classmethod
    def from_config(cls, drafter: DrafterConfig, pipeline_seed: int, target_max_seq_len: int) -> TrainSettings:
        """``drafter``'s settings; its ``seed`` and ``max_seq_len`` default to the pipeline's seed and
        ``target.max_seq_len``."""
        settings = drafter.model_dump(exclude={"model", "seed", "max_seq_len", *NOT_SETTINGS})
        return cls(
            **settings,
            # Variant switches left off are left out, as keys left out are: a plain drafter's spec is unchanged.
            model=drafter.model.model_dump(exclude_defaults=True),
            seed=pipeline_seed if drafter.seed is None else drafter.seed,
            max_seq_len=drafter.max_seq_len or target_max_seq_len,
        )

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
        return {k: v for k, v in asdict(self).items() if k not in skip}


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
    """JSON-able spec for ``eagle3_pipeline.drafter.train.phase:run``. Paths are under ``root``, the
    pipeline's own artifacts root by default: ``run_heavy_phase`` maps them onto the host's."""
    settings = TrainSettings.from_config(config.drafter, config.seed, config.target.max_seq_len)
    paths = drafter_paths(root or config.artifacts_root)
    return {
        **{k: str(v) for k, v in paths.items()},
        "target_weights": target_weights(config.drafter, config.compute),
        "settings": asdict(settings),
    }


def parse_spec(spec: Mapping[str, Any]) -> tuple[dict[str, Path], TrainSettings]:
    """The spec's paths and settings; a missing path or setting, or an unknown setting, is refused by name."""
    missing = [k for k in SPEC_PATHS if not spec.get(k)]
    if missing:
        raise TrainError(f"train spec: missing {', '.join(missing)}")
    raw = dict(spec.get("settings") or {})
    known = {f.name for f in fields(TrainSettings)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise TrainError(f"train spec: settings has unknown keys {unknown}")
    lacking = sorted(known - set(raw))
    if lacking:
        raise TrainError(f"train spec: settings lacks {lacking} (the spec is built by drafter.spec.train_spec)")
    return {k: Path(spec[k]) for k in SPEC_PATHS}, TrainSettings(**raw)
