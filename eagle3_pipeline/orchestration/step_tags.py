"""Where each step runs under the Kubernetes or Celery executor: the step tags those executors read.

A phase gets a GPU of its own only where its own process does GPU work: `responses` when the
pipeline serves the model itself (`inference.kind: embedded`), and the heavy phases
(eagle3_pipeline.config.phases: `hidden_states`, `eagle3_drafter`, `drafter_eval`) when `compute.kind` is
`local`. With `compute: ssh`/`command` or remote endpoints the step only drives a GPU host over the
network, so it runs on an ordinary node or worker; the phases on the managed server's host
(`drafter_benchmark`, `served_drafter`) only drive its server.

- `k8s`: the `dagster-k8s/config` tag — the step pod's container asks for `gpus` × `nvidia.com/gpu`
  (limit = request) and the pod lands on the pool's nodes (`node_selector`).
- `celery`: the `dagster-celery/queue` tag — the pool's queue, served by the Celery workers of that
  GPU host.
"""

from __future__ import annotations

import json
from typing import Any

from eagle3_pipeline.config import ComputeConfig, DeployConfig, GpuPhase, GpuPoolConfig, InferenceConfig
from eagle3_pipeline.config.phases import PHASES

K8S_CONFIG_TAG = "dagster-k8s/config"
CELERY_QUEUE_TAG = "dagster-celery/queue"
GPU_RESOURCE = "nvidia.com/gpu"


def gpu_phases(inference: InferenceConfig, compute: ComputeConfig) -> list[GpuPhase]:
    """The phases whose own process needs a GPU under these settings (module doc), in the table's order: the
    phase the server serves when that server is our own process, the heavy ones when they run here."""
    embedded, local = inference.kind == "embedded", compute.kind == "local"
    return [row.phase for row in PHASES if (row.handover == "serves" and embedded) or (row.heavy and local)]


def pool_for(deploy: DeployConfig, phase: GpuPhase) -> tuple[str, GpuPoolConfig]:
    pools = deploy.gpu_pools
    name = deploy.phase_pools.get(phase, next(iter(pools)))
    return name, pools[name]


def k8s_step_config(pool: GpuPoolConfig) -> dict[str, Any]:
    """The `dagster-k8s/config` value (UserDefinedDagsterK8sConfig's shape, snake_case)."""
    gpus = str(pool.gpus)
    config: dict[str, Any] = {
        "container_config": {"resources": {"limits": {GPU_RESOURCE: gpus}, "requests": {GPU_RESOURCE: gpus}}}
    }
    if pool.node_selector:
        config["pod_spec_config"] = {"node_selector": dict(pool.node_selector)}
    return config


def step_tags(
    deploy: DeployConfig, inference: InferenceConfig, compute: ComputeConfig, phase: GpuPhase
) -> dict[str, str]:
    """The op tags of `phase` for the configured executor; none for the default executor or a
    phase that does no GPU work in its own process."""
    executor = deploy.executor
    if executor == "default" or phase not in gpu_phases(inference, compute):
        return {}
    name, pool = pool_for(deploy, phase)
    if executor == "k8s":
        return {K8S_CONFIG_TAG: json.dumps(k8s_step_config(pool), sort_keys=True)}
    return {CELERY_QUEUE_TAG: pool.queue or name}
