"""The executor the pipeline file asks for (`deploy.executor`); the per-step tags come from
:mod:`eagle3_pipeline.deploy`. The integration libraries are the `k8s` / `celery` extras, imported
only when the file selects them."""

from __future__ import annotations

import dagster as dg

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
