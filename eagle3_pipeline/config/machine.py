"""`machine:` the GPU machine the phases run on, for the resource model (eagle3_pipeline.fit): read live on
the host at each GPU phase's preflight, or declared here for `eagle3-pipeline plan` from a laptop."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from eagle3_pipeline.config.base import ConfigModel


class MachineConfig(ConfigModel):
    """The GPU host as declared. Unset fields are UNKNOWN to `plan`; a GPU phase's preflight measures them."""

    gpu: Annotated[str, Field(min_length=1)] | None = Field(
        default=None,
        description=(
            "The card, as nvidia-smi or its maker names it (H100, H200, B200, A100 80GB, L40S, RTX PRO 6000 "
            "Blackwell, RTX 4090, RTX 5090, MI300X, MI355X): its memory, bandwidth and FLOPs come from "
            "eagle3_pipeline.fit.gpus.GPU_SPECS."
        ),
    )
    gpu_memory_gib: Annotated[float, Field(gt=0)] | None = Field(
        default=None,
        description="Memory per GPU in GiB, nvidia-smi's memory.total / 1024 (a '96 GB' card: 95.6); overrides gpu.",
    )
    gpus: Annotated[int, Field(gt=0)] | None = Field(default=None, description="GPUs on the host.")
    host_memory_gib: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="Host memory (RAM) in GiB available to the phases."
    )
    disk_free_gib: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="Free disk in GiB under the artifacts root where the GPU phases write."
    )
    check: Literal["before_generation", "per_phase", "off"] = Field(
        default="before_generation",
        description=(
            "before_generation: the first responses run refuses to start when a later phase cannot fit (and each GPU "
            "phase checks itself again against the live inventory); per_phase: only each GPU phase's own preflight "
            "refuses (run the phases that fit); off: figures are reported, nothing is refused."
        ),
    )
