"""The GPUs a phase can run on: a spec table of the common cards, found by the name ``nvidia-smi`` prints.

Throughput figures are the vendors' datasheets (dense tensor throughput, no 2:4 sparsity); memory is
``memory.total`` as ``nvidia-smi`` reports it for that card (a "96 GB" card shows 97,887 MiB). Each row names
its source.
Where a datasheet gives only a sparse or FP4 figure, the dense BF16/FP8 figure is derived from it and the
row says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_mib: int  # memory.total as nvidia-smi reports it (the card's memory less the driver's reserve)
    bandwidth_tbs: float  # memory bandwidth, TB/s
    bf16_tflops: float  # dense
    fp8_tflops: float | None  # dense; None: no FP8 tensor cores
    source: str
    aliases: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB


GPU_SPECS: tuple[GpuSpec, ...] = (
    GpuSpec("H100 SXM", 81559, 3.35, 989, 1979, "H100 datasheet (SXM5)", ("h100 80gb", "h100")),
    GpuSpec("H100 PCIe", 81559, 2.0, 756, 1513, "H100 datasheet (PCIe)", ("h100 pcie",)),
    GpuSpec("H100 NVL", 95830, 3.9, 835, 1671, "H100 datasheet (NVL)", ("h100 nvl",)),
    GpuSpec("H200", 143771, 4.8, 989, 1979, "H200 datasheet (SXM)", ("h200",)),
    GpuSpec("B200", 183359, 8.0, 2250, 4500, "DGX B200 datasheet, per GPU", ("b200",)),
    GpuSpec("A100 80GB", 81920, 2.039, 312, None, "A100 datasheet (SXM 80GB)", ("a100-sxm4-80gb", "a100 80gb")),
    GpuSpec("A100 40GB", 40960, 1.555, 312, None, "A100 datasheet (SXM 40GB)", ("a100-sxm4-40gb", "a100")),
    GpuSpec("L40S", 46068, 0.864, 362, 733, "NVIDIA L40S datasheet (dense = half the sparse figures)", ("l40s",)),
    GpuSpec(
        "RTX PRO 6000 Blackwell", 97887, 1.792, 500, 1000,
        "NVIDIA RTX PRO 6000 Blackwell datasheet (4 PFLOPS FP4 sparse: FP8 dense = /4, BF16 dense = /8)",
        ("rtx pro 6000 blackwell", "rtx pro 6000"),
    ),
    GpuSpec("RTX 5090", 32607, 1.792, 209.5, 419, "RTX Blackwell whitepaper, FP32 acc.", ("rtx 5090",)),
    GpuSpec("RTX 4090", 24564, 1.008, 165.2, 330.3, "Ada whitepaper, FP32 acc.", ("rtx 4090",)),
    GpuSpec("MI300X", 196592, 5.3, 1307, 2615, "AMD Instinct MI300X datasheet", ("mi300x",)),
    GpuSpec("MI355X", 294896, 8.0, 2500, 5000, "AMD Instinct MI355X datasheet", ("mi355x",)),
)  # fmt: skip


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def gpu_spec(name: str) -> GpuSpec | None:
    """The table's row for a card named as a user or ``nvidia-smi`` writes it ("NVIDIA H200", "h100",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition"): the longest matching name or alias wins."""
    wanted = _norm(name)
    best: tuple[int, GpuSpec] | None = None
    for spec in GPU_SPECS:
        for alias in (spec.name, *spec.aliases):
            key = _norm(alias)
            if key and (wanted == key or re.search(rf"\b{re.escape(key)}\b", wanted)):
                if best is None or len(key) > best[0]:
                    best = (len(key), spec)
    return best[1] if best else None


def known_gpus() -> str:
    return ", ".join(spec.name for spec in GPU_SPECS)
