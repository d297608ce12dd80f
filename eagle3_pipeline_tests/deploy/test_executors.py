"""The Kubernetes and Celery executors, as far as a machine without a cluster or a broker goes.

Kubernetes: the step Job of each GPU phase is built by dagster-k8s's own code from the asset's op tags
(`get_user_defined_k8s_config` — what `k8s_job_executor` reads — and `construct_dagster_k8s_job`),
then round-tripped through the `kubernetes` client's `V1Job` model with dagster-k8s's strict
`k8s_model_from_dict`. Celery: the definitions load with the celery executor and each GPU step carries
its host's queue. No pod is scheduled and no Celery worker runs here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._core.execution.api import create_execution_plan

from eagle3_pipeline.components.execution.deploy import CELERY_BACKEND_ENV, CELERY_BROKER_ENV
from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import ConfigError
from eagle3_pipeline.orchestration.step_tags import CELERY_QUEUE_TAG, K8S_CONFIG_TAG, gpu_phases
from eagle3_pipeline_tests.pipeline_files import load_pipeline

kubernetes = pytest.importorskip("kubernetes")
dagster_k8s_job = pytest.importorskip("dagster_k8s.job")
dagster_k8s_models = pytest.importorskip("dagster_k8s.models")

GPU_ASSETS = ("hidden_states", "eagle3_drafter", "drafter_eval")
H200 = {"nvidia.com/gpu.product": "NVIDIA-H200"}
A100 = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}


def op_tags(defs: dg.Definitions, asset: str) -> dict[str, str]:
    return dict(defs.get_assets_def(asset).op.tags)


def step_job(tags: dict[str, str]) -> Any:
    """The step Job k8s_job_executor would create for a step with these tags, as a validated V1Job."""
    job_config = dagster_k8s_job.DagsterK8sJobConfig(
        job_image="registry.example/eagle3-pipeline:1",
        dagster_home="/opt/dagster/home",
        instance_config_map="dagster-instance",
    )
    built = dagster_k8s_job.construct_dagster_k8s_job(
        job_config,
        args=["dagster", "api", "execute_step"],
        job_name="dagster-step-0123456789",
        user_defined_k8s_config=dagster_k8s_job.get_user_defined_k8s_config(tags),
        component="step_worker",
    )
    as_dict = kubernetes.client.ApiClient().sanitize_for_serialization(built)
    snake = dagster_k8s_models.k8s_snake_case_dict(kubernetes.client.V1Job, as_dict)
    return dagster_k8s_models.k8s_model_from_dict(kubernetes.client.V1Job, snake)


def test_k8s_step_jobs_request_gpus_on_each_pools_nodes(tmp_path: Path) -> None:
    deploy = {
        "executor": "k8s",
        "gpu_pools": {"h200": {"node_selector": H200, "gpus": 8}, "a100": {"node_selector": A100, "gpus": 2}},
        "phase_pools": {"drafter_eval": "a100"},
    }
    config = load_pipeline(tmp_path, {"deploy": deploy})
    assert gpu_phases(config.inference, config.compute) == [
        "responses",
        "hidden_states",
        "eagle3_drafter",
        "drafter_eval",
    ]
    defs = build_definitions(config)
    assert defs.resolve_job_def("downstream_job").executor_def.name == "k8s"

    expected = {
        "responses": (H200, "8"),
        "hidden_states": (H200, "8"),
        "eagle3_drafter": (H200, "8"),
        "drafter_eval": (A100, "2"),
    }
    for asset, (selector, gpus) in expected.items():
        job = step_job(op_tags(defs, asset))
        pod = job.spec.template.spec
        [container] = pod.containers
        assert container.resources.limits == {"nvidia.com/gpu": gpus}, asset
        assert container.resources.requests == {"nvidia.com/gpu": gpus}, asset
        assert pod.node_selector == selector, asset
        assert container.image == "registry.example/eagle3-pipeline:1"
    # A phase without GPU work gets a plain pod.
    plain = step_job(op_tags(defs, "training_data")).spec.template.spec
    assert plain.node_selector is None and not (plain.containers[0].resources and plain.containers[0].resources.limits)


def test_remote_compute_and_endpoints_keep_gpu_requests_off_the_step_pods(tmp_path: Path) -> None:
    """With `compute: ssh` and a remote endpoint the step only drives a GPU host: no GPU for its pod."""
    endpoints = {"kind": "endpoints", "endpoints": [{"base_url": "http://127.0.0.1:9/v1"}]}
    ssh = {"kind": "ssh", "host": {"hostname": "gpu-a", "username": "u"}, "workdir": "/w", "artifacts_root": "/data"}
    deploy = {"executor": "k8s", "gpu_pools": {"h200": {"node_selector": H200}}}
    config = load_pipeline(tmp_path, {"deploy": deploy, "compute": ssh, "inference": endpoints})
    assert gpu_phases(config.inference, config.compute) == []
    defs = build_definitions(config)
    for asset in ("responses", *GPU_ASSETS):
        assert K8S_CONFIG_TAG not in op_tags(defs, asset), asset


def test_celery_executor_loads_and_routes_each_gpu_phase_to_its_hosts_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("dagster_celery")
    deploy = {
        "executor": "celery",
        "gpu_pools": {"gpu-a": {}, "gpu-b": {"queue": "gpu-b-h200"}},
        "phase_pools": {"eagle3_drafter": "gpu-b"},
    }
    defs = build_definitions(load_pipeline(tmp_path, {"deploy": deploy}))
    for job in ("generation_job", "downstream_job"):
        assert defs.resolve_job_def(job).executor_def.name == "celery_executor"
    queues = {
        asset: op_tags(defs, asset).get(CELERY_QUEUE_TAG)
        for asset in ("prompts", "responses", "training_data", *GPU_ASSETS)
    }
    assert queues == {
        "prompts": None,
        "training_data": None,  # the default queue
        "responses": "gpu-a",
        "hidden_states": "gpu-a",
        "drafter_eval": "gpu-a",
        "eagle3_drafter": "gpu-b-h200",
    }
    # The tags as the executor reads them: from the steps of a run's execution plan (which resolves
    # the executor's config, so the broker variables must be set; nothing connects to them here).
    monkeypatch.setenv(CELERY_BROKER_ENV, "pyamqp://guest@127.0.0.1:9//")
    monkeypatch.setenv(CELERY_BACKEND_ENV, "rpc://")
    plan = create_execution_plan(defs.resolve_job_def("downstream_job"))
    assert (plan.get_step_by_key("eagle3_drafter").tags or {})[CELERY_QUEUE_TAG] == "gpu-b-h200"
    assert CELERY_QUEUE_TAG not in (plan.get_step_by_key("draft_vocab").tags or {})


def test_default_executor_adds_no_tags_and_unknown_pool_is_a_clear_error(tmp_path: Path) -> None:
    defs = build_definitions(load_pipeline(tmp_path))
    assert all(
        K8S_CONFIG_TAG not in op_tags(defs, a) and CELERY_QUEUE_TAG not in op_tags(defs, a)
        for a in ("responses", *GPU_ASSETS)
    )
    with pytest.raises(
        ConfigError, match=r"deploy: .*phase_pools names pools not in gpu_pools.*'hidden_states': 'nope'"
    ):
        load_pipeline(tmp_path, {"deploy": {"phase_pools": {"hidden_states": "nope"}}})


def test_k8s_instance_file_is_deploy_dagster_yaml_plus_a_valid_k8s_run_launcher() -> None:
    import yaml
    from dagster._config import process_config
    from dagster_k8s import K8sRunLauncher

    deploy = Path(__file__).resolve().parents[2] / "deploy"
    base = yaml.safe_load((deploy / "dagster.yaml").read_text())
    k8s = yaml.safe_load((deploy / "k8s" / "dagster.yaml").read_text())
    launcher = k8s.pop("run_launcher")
    assert k8s == base, "deploy/k8s/dagster.yaml drifted from deploy/dagster.yaml"
    assert (launcher["module"], launcher["class"]) == ("dagster_k8s", "K8sRunLauncher")
    result = process_config(K8sRunLauncher.config_type(), launcher["config"])
    assert result.success, result.errors
