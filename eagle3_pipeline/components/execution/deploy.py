"""The code location's one executor: the one its pipeline files ask for (`deploy.executor`), set once
over all of them (:func:`with_executor`, called by `eagle3_pipeline/definitions.py`), not per pipeline:
`Definitions.merge` refuses two executor objects, and Dagster has one default executor per code
location. The per-step tags come from :mod:`eagle3_pipeline.orchestration.step_tags`. The integration libraries are the
`k8s` / `celery` extras, imported only when a file selects them."""

from __future__ import annotations

from collections.abc import Sequence

import dagster as dg

from eagle3_pipeline.components.resources import PipelineResource
from eagle3_pipeline.config import ConfigError, PipelineConfig

CELERY_BROKER_ENV = "DAGSTER_CELERY_BROKER_URL"
CELERY_BACKEND_ENV = "DAGSTER_CELERY_BACKEND_URL"


def build_executor(config: PipelineConfig) -> dg.ExecutorDefinition | None:
    """None keeps Dagster's default executor."""
    kind = config.deploy.executor
    if kind == "default":
        return None
    extra = {"k8s": "dagster-k8s", "celery": "dagster-celery"}[kind]
    try:
        if kind == "k8s":
            from dagster_k8s import k8s_job_executor

            # Image, namespace, instance config map and secrets come from the K8sRunLauncher of the
            # instance (deploy/k8s/dagster.yaml); nothing here needs configuring.
            return k8s_job_executor
        from dagster_celery import celery_executor
    except ImportError:
        raise ConfigError(
            f"{config.source_file}: deploy.executor: {kind!r} needs {extra} (pip install 'eagle3-pipeline[{kind}]')"
        ) from None
    # The broker URL may carry a password: it comes from the environment, never from a file.
    return celery_executor.configured(
        {"broker": {"env": CELERY_BROKER_ENV}, "backend": {"env": CELERY_BACKEND_ENV}}, name="celery_executor"
    )


def code_location_executor(configs: Sequence[PipelineConfig]) -> dg.ExecutorDefinition | None:
    """The executor every one of ``configs`` asks for; files that ask for different ones are refused,
    naming them."""
    kinds = {config.deploy.executor: config for config in configs}
    if len(kinds) > 1:
        asked = ", ".join(f"{config.source_file} asks for {kind!r}" for kind, config in kinds.items())
        raise ConfigError(
            f"deploy.executor: {asked}; a code location runs every job on one executor: give each pipeline file "
            "in it the same deploy.executor, or serve the pipelines from separate code locations"
        )
    return build_executor(configs[0]) if configs else None


def with_executor(defs: dg.Definitions, configs: Sequence[PipelineConfig] | None = None) -> dg.Definitions:
    """``defs`` (a code location's pipelines) with the executor their files ask for; ``configs``: the
    files, by default each `PipelineResource`'s in ``defs``."""
    if configs is None:
        configs = [r.config() for r in (defs.resources or {}).values() if isinstance(r, PipelineResource)]
    executor = code_location_executor(configs)
    return defs if executor is None else dg.Definitions.merge(defs, dg.Definitions(executor=executor))
