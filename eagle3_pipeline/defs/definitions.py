"""Compose the Dagster definitions for one pipeline file."""

from __future__ import annotations

import dagster as dg

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.defs.assets import build_assets
from eagle3_pipeline.defs.drafter_benchmark import build_drafter_benchmark
from eagle3_pipeline.defs.drafter_eval import build_drafter_eval
from eagle3_pipeline.defs.health import build_health_sensors, inference_server
from eagle3_pipeline.defs.resources import InferenceResource

GENERATION_JOB = "generation_job"


def build_definitions(config: PipelineConfig) -> dg.Definitions:
    assets = build_assets(config)
    assets += build_drafter_eval(config)
    assets += build_drafter_benchmark(config)
    generation_job = dg.define_asset_job(
        GENERATION_JOB,
        selection=dg.AssetSelection.assets("prompts", "responses"),
        description="Prompts and responses for one dataset partition.",
    )
    return dg.Definitions(
        assets=[*assets, inference_server],
        jobs=[generation_job],
        sensors=build_health_sensors(config, GENERATION_JOB),
        resources={
            "inference": InferenceResource(config_path=str(config.source_file)),
            "pipes_subprocess_client": dg.PipesSubprocessClient(),
        },
    )
