"""The train spec's settings as a pipeline file gives them, for tests and benchmarks that run the
``train`` phase on a store of their own (the pipeline file's validation, not a copy of its defaults),
and a whole spec over a small random store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_pipeline.config import DrafterConfig
from eagle3_pipeline.drafter.spec import TrainSettings
from eagle3_pipeline.testing.tiny_store import random_store, random_target

PIPELINE_SEED = 0
TARGET_MAX_SEQ_LEN = 2048


def train_settings(**drafter: Any) -> dict[str, Any]:
    """``settings`` of the spec :func:`~eagle3_pipeline.drafter.spec.train_spec` writes for a file whose
    ``drafter:`` section holds these keys (validated as the file's are); seed and max_seq_len, where
    they are not given, are those of a pipeline with seed 0 and ``target.max_seq_len`` 2048."""
    config = DrafterConfig.model_validate(drafter)
    return TrainSettings.from_config(config, PIPELINE_SEED, TARGET_MAX_SEQ_LEN).as_spec()


def random_store_train_spec(folder: Path, **settings: Any) -> dict[str, Any]:
    """A ``train`` spec over a random target and a 60-sample store of it in ``folder`` (made once), with
    small fast settings (3 TTT steps, 2 epochs of 96-token batches, a checkpoint every 4 steps) and
    ``settings`` over them; the run and export folders under ``folder`` too."""
    target = random_target(folder / "target")
    if not (folder / "store").exists():
        random_store(folder / "store", folder / "vocab", target_dir=target, samples=60, draft_vocab_size=40)
    base = train_settings(
        ttt_steps=3, lr=3e-3, epochs=2, batch_tokens=96, max_seq_len=32, checkpoint_every=4, log_every=2,
        eval_samples=8, seed=7,
    )  # fmt: skip
    return {
        "store": str(folder / "store"),
        "draft_vocab": str(folder / "vocab"),
        "target_weights": str(target),
        "run_dir": str(folder / "run"),
        "export_dir": str(folder / "export"),
        "settings": {**base, **settings},
    }
