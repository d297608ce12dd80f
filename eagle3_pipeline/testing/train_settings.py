"""The train spec's settings as a pipeline file gives them, for tests and benchmarks that run the
``train`` phase on a store of their own (the pipeline file's validation, not a copy of its defaults),
a whole spec over a small random store, and a drafter trained on a target's greedy continuations (the
recipe of the served-τ checks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import DrafterConfig
from eagle3_pipeline.drafter.spec import TrainSettings
from eagle3_pipeline.testing.tiny_store import greedy_store, random_store, random_target

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


@dataclass
class GreedyTrained:
    """A drafter trained by :func:`train_on_greedy_store`: its target, export, the prompts' token ids (what a
    server is asked to continue) and the train phase's result (its last eval is the export's τ)."""

    target: Path
    export: Path
    prompt_ids: list[list[int]]
    result: dict[str, Any]


def train_on_greedy_store(
    work: Path,
    target: Path,
    prompts: list[str],
    *,
    new_tokens: int,
    epochs: int,
    steps: int,
    model: dict[str, Any],
    draft_vocab: int = 256,
) -> GreedyTrained:
    """A store in ``work`` of ``target``'s greedy continuations of ``prompts`` (``new_tokens`` each, every row in
    both splits) and a drafter (``drafter.model``: ``model``) trained on it by the train phase, lr 1e-2, one
    checkpoint at the end, exported: the drafter a greedy server must accept as often as its last eval says."""
    from eagle3_pipeline.drafter.train.phase import run
    from eagle3_pipeline.testing.reporter import Recorder

    prompt_ids = greedy_store(work / "store", work / "vocab", target, prompts, new_tokens, draft_vocab)
    settings = train_settings(
        ttt_steps=steps, lr=1e-2, epochs=epochs, batch_tokens=1024, max_seq_len=128, checkpoint_every=epochs,
        eval_samples=len(prompts), seed=0, model=model,
    )  # fmt: skip
    spec = {
        "store": str(work / "store"),
        "draft_vocab": str(work / "vocab"),
        "target_weights": str(target),
        "run_dir": str(work / "run"),
        "export_dir": str(work / "export"),
        "settings": settings,
    }
    return GreedyTrained(target, work / "export", prompt_ids, run(spec, Recorder()))
