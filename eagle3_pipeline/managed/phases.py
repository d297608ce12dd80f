"""What the GPU phases ask of the managed server: which one shares their GPUs, and what it serves afterwards.

- **Where a phase's GPUs are**: its row's ``machine`` (eagle3_pipeline.config.phases): ``compute`` — where
  ``compute:`` says, this machine (``local``) or ``compute.host``; ``server`` — the health host, the managed
  server's own. A phase shares its GPUs with the managed server on the same machine (:func:`same_machine`);
  a server on another machine is left alone.
- **Generation work remains** while some ``responses`` partition is not complete. Decided from the
  artifacts alone, without the Dagster instance: a partition is complete when its responses table exists,
  is not older than its checkpoint (an answer appended after the table was written belongs to a run that
  did not finish) nor than its prompts table (new prompts are not answered yet), and the checkpoint's
  stored fingerprint is the configured one (other generation settings mean a regeneration). A stat and
  a small JSON file per dataset.
- **What the server serves afterwards**: the generation server when such work remains
  (:func:`~eagle3_pipeline.managed.servers.generation_purpose`), else nothing (it stays stopped).
"""

from __future__ import annotations

from eagle3_pipeline.config import ComputeConfig, HealthConfig, HostConfig, PipelineConfig
from eagle3_pipeline.config.phases import GpuPhase, phase_row
from eagle3_pipeline.generation.fingerprint import (
    FingerprintMismatch,
    configured_fingerprint,
    digest_of,
    read_fingerprint,
)
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed.launch import ServerPurpose
from eagle3_pipeline.managed.servers import ServerSetup, generation_purpose, managed_servers


def same_machine(a: HostConfig, b: HostConfig) -> bool:
    """Both this machine, or the same SSH host (name, case-insensitive, and port)."""
    if a.kind != b.kind:
        return False
    if a.kind == "local":
        return True
    return (a.hostname or "").lower() == (b.hostname or "").lower() and a.port == b.port


def phase_host(compute: ComputeConfig, health: HealthConfig, phase: GpuPhase) -> HostConfig:
    """The machine whose GPUs ``phase`` uses (module doc)."""
    if phase_row(phase).machine == "server":
        return health.host
    return HostConfig() if compute.kind == "local" else compute.host


def gpu_phase_server(config: PipelineConfig, phase: GpuPhase) -> ServerSetup | None:
    """The managed server on the machine ``phase`` uses, or None (no managed server there)."""
    where = phase_host(config.compute, config.health, phase)
    return next((setup for setup in managed_servers(config) if same_machine(setup.host, where)), None)


def partition_complete(layout: ArtifactLayout, configured: str, dataset_id: str) -> bool:
    """Whether the ``responses`` partition of ``dataset_id`` is complete (module doc); ``configured``: the digest
    of the configured generation fingerprint."""
    table = layout.responses(dataset_id)
    if not table.is_file():
        return False
    written = table.stat().st_mtime
    if any(
        path.is_file() and path.stat().st_mtime > written
        for path in (layout.checkpoint(dataset_id), layout.prompts(dataset_id))
    ):
        return False
    try:
        stored = read_fingerprint(layout.fingerprint(dataset_id))
    except FingerprintMismatch:
        return False
    return stored is None or digest_of(stored["fingerprint"]) == configured


def incomplete_partitions(config: PipelineConfig) -> list[str]:
    """The datasets whose ``responses`` partition is not complete, in file order."""
    layout = ArtifactLayout(config.artifacts_root)
    configured = configured_fingerprint(config.generation, config.target, config.inference).digest
    return [dataset for dataset in config.dataset_ids if not partition_complete(layout, configured, dataset)]


def after_gpu_phase(config: PipelineConfig) -> ServerPurpose | None:
    """What the server serves once a GPU phase is done: generation while work remains, else nothing."""
    if not incomplete_partitions(config):
        return None
    return generation_purpose(ArtifactLayout(config.artifacts_root), config.dataset_ids)
