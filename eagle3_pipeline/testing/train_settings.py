"""The train spec's settings as a pipeline file gives them, for tests and benchmarks that run the
``train`` phase on a store of their own (the pipeline file's validation, not a copy of its defaults)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from eagle3_pipeline.config import DrafterConfig
from eagle3_pipeline.drafter.spec import TrainSettings

PIPELINE_SEED = 0
TARGET_MAX_SEQ_LEN = 2048


def train_settings(**drafter: Any) -> dict[str, Any]:
    """``settings`` of the spec :func:`~eagle3_pipeline.drafter.spec.train_spec` writes for a file whose
    ``drafter:`` section holds these keys (validated as the file's are); seed and max_seq_len, where
    they are not given, are those of a pipeline with seed 0 and ``target.max_seq_len`` 2048."""
    config = DrafterConfig.model_validate(drafter)
    return asdict(TrainSettings.from_config(config, PIPELINE_SEED, TARGET_MAX_SEQ_LEN))
