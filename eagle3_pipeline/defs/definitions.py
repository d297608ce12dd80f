"""Compose the Dagster definitions for one pipeline file."""

from __future__ import annotations

import dagster as dg

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.defs.assets import build_assets
from eagle3_pipeline.defs.automation import build_automation_sensor
from eagle3_pipeline.defs.deploy import build_executor
from eagle3_pipeline.defs.drafter import build_drafter_assets
from eagle3_pipeline.defs.drafter_benchmark import build_drafter_benchmark
from eagle3_pipeline.defs.drafter_eval import build_drafter_eval
from eagle3_pipeline.defs.eagle3 import build_eagle3_assets
from eagle3_pipeline.defs.health import build_health_sensors, inference_server_specs
from eagle3_pipeline.defs.launching import GENERATION_JOB
from eagle3_pipeline.defs.resources import ApiKeys, InferenceResource, PipelineResource, api_key_vars
from eagle3_pipeline.results import NO_LISTENER

SETUP_JOB = "setup_job"
DOWNSTREAM_JOB = "downstream_job"
# The main job, as `eagle3-pipeline run` executes it: each of these jobs in turn, the partitioned one
# once per partition. Any asset added downstream of `responses` joins `downstream_job` by itself.
MAIN_PATH = (SETUP_JOB, GENERATION_JOB, DOWNSTREAM_JOB)

PER_DATASET = dg.AssetSelection.assets("prompts", "responses")


def build_jobs(config: PipelineConfig) -> list[dg.UnresolvedAssetJobDefinition]:
    jobs = []
    if config.inference.kind == "embedded":
        jobs.append(
            dg.define_asset_job(
                SETUP_JOB,
                selection=PER_DATASET.upstream() - PER_DATASET,
                description="What the per-dataset phases need first (the embedded model).",
            )
        )
    jobs.append(
        dg.define_asset_job(
            GENERATION_JOB, selection=PER_DATASET, description="Prompts and responses for one dataset partition."
        )
    )
    jobs.append(
        dg.define_asset_job(
            DOWNSTREAM_JOB,
            selection=dg.AssetSelection.assets("responses").downstream(include_self=False),
            description="Every phase after responses (training_data and what follows), over all datasets.",
        )
    )
    return jobs


def build_definitions(config: PipelineConfig, pipeline: PipelineResource | None = None) -> dg.Definitions:
    """The definitions whose shape (assets, partitions = the file's dataset ids) follows `config`,
    the file as loaded; every body reads its settings at run or tick time from `pipeline` (default:
    that file, no overrides). API keys reach the runs through `inference`, each set with
    `dg.EnvVar` of the variable the file names, so an unset variable fails only the runs that need it."""
    pipeline = pipeline or PipelineResource(config_path=str(config.source_file))
    assets = [
        *build_assets(config, pipeline),
        *build_eagle3_assets(config),
        *build_drafter_assets(config),
        *build_drafter_eval(config),
        *build_drafter_benchmark(config),
    ]
    return dg.Definitions(
        assets=[*assets, *inference_server_specs(config)],
        jobs=build_jobs(config),
        sensors=[*build_health_sensors(config, GENERATION_JOB), build_automation_sensor()],
        resources={
            "pipeline": pipeline,
            "inference": InferenceResource(
                pipeline=pipeline, api_keys=ApiKeys(values={var: dg.EnvVar(var) for var in api_key_vars(config)})
            ),
            "pipes_subprocess_client": dg.PipesSubprocessClient(),
            # `eagle3-pipeline run` passes its own, which hears progress and results in process.
            "phase_listener": NO_LISTENER,
        },
        executor=build_executor(config),
    )
