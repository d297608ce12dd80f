"""One pipeline as Dagster definitions: :func:`build_definitions` composes the areas' factories for one
pipeline file, and :class:`Eagle3Pipeline` is the `dg` component that a `defs.yaml` instances with
that file (the code location's pipeline is `defs/local/defs.yaml`, the shipped local profile). More
instances in the defs folder are more pipelines, each with its own `key_prefix`
(:class:`~eagle3_pipeline.orchestration.names.PipelineNames`)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import dagster as dg
from pydantic import Field

from eagle3_pipeline.components.eagle3.drafter_benchmark import build_drafter_benchmark
from eagle3_pipeline.components.eagle3.drafter_eval import build_drafter_eval
from eagle3_pipeline.components.eagle3.eagle3_drafter import build_drafter_assets
from eagle3_pipeline.components.eagle3.hidden_states import build_eagle3_assets
from eagle3_pipeline.components.eagle3.served_drafter import build_served_drafter
from eagle3_pipeline.components.execution.automation import build_automation_sensor
from eagle3_pipeline.components.execution.deploy import with_executor
from eagle3_pipeline.components.generation.automation import scheduled_backfill
from eagle3_pipeline.components.generation.checks import build_response_checks, build_training_data_checks
from eagle3_pipeline.components.generation.prompts import build_prompts
from eagle3_pipeline.components.generation.responses import build_responses
from eagle3_pipeline.components.generation.target_model import build_target_model
from eagle3_pipeline.components.generation.training_data import build_training_data
from eagle3_pipeline.components.health.inference_server import inference_server_specs
from eagle3_pipeline.components.health.sensors import build_health_sensors
from eagle3_pipeline.components.resources import ApiKeys, InferenceResource, PipelineResource, api_key_vars
from eagle3_pipeline.config import PipelineConfig, load_config
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames
from eagle3_pipeline.orchestration.partition_runs import GENERATION_JOB, PER_DATASET
from eagle3_pipeline.results import NO_LISTENER

SETUP_JOB = DEFAULT_NAMES.name("setup_job")
DOWNSTREAM_JOB = DEFAULT_NAMES.name("downstream_job")
# The main job, as `eagle3-pipeline run` executes it: each of these jobs in turn, the partitioned one
# once per partition. Any asset added downstream of `responses` joins `downstream_job` by itself.
MAIN_PATH = (SETUP_JOB, GENERATION_JOB, DOWNSTREAM_JOB)
CODE_REFERENCES_BETA = r".*`(with_source_code_references|LocalFileCodeReference|CodeReferencesMetadataValue)`"


def build_jobs(loaded: PipelineConfig, names: PipelineNames = DEFAULT_NAMES) -> list[dg.UnresolvedAssetJobDefinition]:
    per_dataset = dg.AssetSelection.assets(*(names.key(asset) for asset in PER_DATASET))
    jobs = []
    if loaded.inference.kind == "embedded":
        jobs.append(
            dg.define_asset_job(
                names.name("setup_job"),
                selection=per_dataset.upstream() - per_dataset,
                description="What the per-dataset phases need first (the embedded model).",
            )
        )
    jobs.append(
        dg.define_asset_job(
            names.generation_job,
            selection=per_dataset,
            description="Prompts and responses for one dataset partition.",
        )
    )
    jobs.append(
        dg.define_asset_job(
            names.name("downstream_job"),
            selection=dg.AssetSelection.assets(names.key("responses")).downstream(include_self=False),
            description="Every phase after responses (training_data and what follows), over all datasets.",
        )
    )
    return jobs


def with_code_references(assets: Sequence[dg.AssetsDefinition]) -> list[dg.AssetsDefinition]:
    """Each asset with a code reference to the function that computes it (the module function named after
    it, which its factory decorates): the UI's source link opens it (the component adds its defs.yaml
    after). Checks stay as they are. Code references are a beta feature of Dagster, whose warnings are
    expected for this call only."""
    checks = [a for a in assets if isinstance(a, dg.AssetChecksDefinition)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", CODE_REFERENCES_BETA, dg.BetaWarning)
        referenced = dg.with_source_code_references([a for a in assets if not isinstance(a, dg.AssetChecksDefinition)])
    return [a for a in referenced if isinstance(a, dg.AssetsDefinition)] + checks


def generation_assets(loaded: PipelineConfig, pipeline: PipelineResource) -> list[dg.AssetsDefinition]:
    """The generation assets, each from its module's factory, and their checks: `target_model` (the embedded
    profile only) and `prompts` before `responses`, then `training_data`. Their shape follows `loaded`
    (partitions, code version, descriptions), their names `pipeline`'s key_prefix."""
    names = pipeline.names()
    partitions = dg.StaticPartitionsDefinition(loaded.dataset_ids)
    backfill = scheduled_backfill(loaded, pipeline)
    target = [build_target_model(names)] if loaded.inference.kind == "embedded" else []
    prompts = build_prompts(names, partitions, backfill)
    responses = build_responses(loaded, names, partitions=partitions, backfill=backfill, deps=[prompts, *target])
    training_data = build_training_data(names, responses)
    return [
        *target,
        prompts,
        responses,
        training_data,
        *build_response_checks(loaded, responses, names),
        *build_training_data_checks(loaded, training_data, names),
    ]


def build_definitions(loaded: PipelineConfig, pipeline: PipelineResource | None = None) -> dg.Definitions:
    """A code location of one pipeline: :func:`pipeline_definitions` with the executor its file asks for."""
    return with_executor(pipeline_definitions(loaded, pipeline), [loaded])


def pipeline_definitions(loaded: PipelineConfig, pipeline: PipelineResource | None = None) -> dg.Definitions:
    """One pipeline's definitions, without an executor (the code location sets one for all its
    pipelines: :func:`~eagle3_pipeline.components.execution.deploy.with_executor`). Their shape (assets, partitions
    = the file's dataset ids) follows `loaded`, the file as loaded; every body reads its settings at run
    or tick time from `pipeline` (default: that file, no overrides). API keys reach the runs through
    `inference`, each set with `dg.EnvVar` of the variable the file names, so an unset variable fails
    only the runs that need it. Every name (asset and check keys, jobs, sensors, resource keys) follows
    `pipeline.key_prefix`. Pools and step tags are each asset's
    :func:`~eagle3_pipeline.components.policy.step_policy`."""
    pipeline = pipeline or PipelineResource(config_path=str(loaded.source_file))
    names = pipeline.names()
    assets = [
        *generation_assets(loaded, pipeline),
        *build_eagle3_assets(loaded, names),
        *build_drafter_assets(loaded, names),
        *build_drafter_eval(loaded, names),
        *build_drafter_benchmark(loaded, names),
        *build_served_drafter(loaded, names),
    ]
    observed = inference_server_specs(loaded, names)
    keys = [key for a in assets if isinstance(a, dg.AssetsDefinition) for key in a.keys]
    return dg.Definitions(
        assets=[*with_code_references(assets), *observed],
        jobs=build_jobs(loaded, names),
        sensors=[
            *build_health_sensors(loaded, names),
            build_automation_sensor(names, keys + [s.key for s in observed]),
        ],
        resources={
            names.pipeline: pipeline,
            names.inference: InferenceResource(
                pipeline=pipeline, api_keys=ApiKeys(values={var: dg.EnvVar(var) for var in api_key_vars(loaded)})
            ),
            names.pipes_subprocess_client: dg.PipesSubprocessClient(),
            # `eagle3-pipeline run` passes its own, which hears progress and results in process.
            names.phase_listener: NO_LISTENER,
        },
    )


class Eagle3Pipeline(dg.Component, dg.Resolvable, dg.Model):
    """An EAGLE-3 pipeline (prompts → responses → training_data → draft_vocab → hidden_states →
    eagle3_drafter → drafter_eval) built from one pipeline file. Loading reads only the file: missing
    source files and unset API-key variables are reported by the run that needs them, so the
    webserver and the daemon load in any environment."""

    config_file: str = Field(
        description="The pipeline YAML file (e.g. a profile of eagle3_pipeline/profiles); a relative path "
        "is read from the folder of this defs.yaml. Its settings are read again by each run and tick."
    )
    artifacts_root: str | None = Field(
        default=None,
        description="Replaces the file's artifacts_root for every phase (absolute, or relative to the "
        "working directory of the run); empty: the file's.",
    )
    key_prefix: str | None = Field(
        default=None,
        description="Namespaces this pipeline in a code location that holds several: its asset keys become "
        "`<prefix>/prompts`, ..., its jobs, sensors and resource keys `<prefix>__generation_job`, ... "
        "(letters, digits, underscores). Empty: the plain names, which the CLI uses; one instance at most may "
        "leave it empty.",
    )

    def config_path(self, folder: Path) -> Path:
        path = Path(self.config_file).expanduser()
        return path if path.is_absolute() else (folder / path).resolve()

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        path = self.config_path(context.path)
        config = load_config(path, runtime_checks=False)
        pipeline = PipelineResource(
            config_path=str(path), artifacts_root=self.artifacts_root, key_prefix=self.key_prefix
        )
        return pipeline_definitions(config, pipeline)
