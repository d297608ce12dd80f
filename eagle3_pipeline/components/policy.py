"""Where each step runs, decided once for all of a pipeline's assets: the `gpu` pool of the steps that hold
GPUs (of this machine or of a GPU host: the phases of eagle3_pipeline.config.phases, one at a time through the
pool), and the executor's step tags of their phase
(:func:`eagle3_pipeline.orchestration.step_tags.step_tags`). Every factory passes
``**step_policy(loaded, asset)`` to its asset decorator, so no factory decides either itself."""

from __future__ import annotations

from typing import Any

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.config.phases import GPU_PHASES
from eagle3_pipeline.orchestration.step_tags import step_tags

GPU_POOL = "gpu"


def step_policy(loaded: PipelineConfig, asset: str) -> dict[str, Any]:
    """The ``pool`` and ``op_tags`` of ``asset``'s decorator under the file as loaded. With several inference
    hosts, `responses` runs are kept one per host by their `eagle3/host` and `eagle3/pool` tags instead
    (orchestration/hosts.py): Dagster fixes an op's pool in its definition, not per run."""
    for phase in GPU_PHASES:
        if phase == asset:
            pool = None if phase == "responses" and loaded.inference.hosts else GPU_POOL
            return {"pool": pool, "op_tags": step_tags(loaded.deploy, loaded.inference, loaded.compute, phase)}
    return {}
