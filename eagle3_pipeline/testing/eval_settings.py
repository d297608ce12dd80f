"""The ``evaluate`` spec's settings as a pipeline file gives them, for tests and benchmarks that run the
phase on a store of their own (the pipeline file's validation and defaults, not a copy of them)."""

from __future__ import annotations

from typing import Any

from eagle3_pipeline.config import DrafterConfig, DrafterEvalConfig
from eagle3_pipeline.drafter.evaluate.phase import spec_settings


def eval_settings(**drafter_eval: Any) -> dict[str, Any]:
    """The spec's settings for a file whose ``drafter_eval:`` section holds these keys (validated as the
    file's are) and whose ``drafter:`` section names no tensor."""
    return spec_settings(DrafterEvalConfig.model_validate(drafter_eval), DrafterConfig())
