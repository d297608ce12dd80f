"""The machine read live over SSH (a real sshd on loopback; the GPUs are the scripted nvidia-smi's 8 × H200, this
machine has none), what the declaration fills in, and the weights of the Kimi-shaped checkpoint from its real
safetensors headers (MLA's low-rank projections replicated on every rank)."""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.config import MachineConfig
from eagle3_pipeline.fit.checkpoint import read_weights
from eagle3_pipeline.fit.machine import combined, declared, live
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd, gpu_row

MIB = 1 << 20


def test_live_machine_over_ssh(sshd: Sshd, fakebin: FakeBin, tmp_path: Path) -> None:
    fakebin.reset()
    with sshd.host() as host:
        machine = live(host, str(tmp_path / "not" / "yet"), "127.0.0.1")
    assert (machine.gpus, machine.gpu_name, machine.gpu_bytes) == (8, "NVIDIA H200", 143771 * MIB)
    assert machine.spec is not None and machine.spec.name == "H200"
    assert machine.disk_bytes and machine.host_bytes, "df under the nearest existing folder, MemAvailable"
    kept = combined(machine, declared(MachineConfig(gpu="RTX 4090", gpus=1, disk_free_gib=1)))
    assert (kept.gpus, kept.gpu_name, kept.disk_bytes) == (8, "NVIDIA H200", machine.disk_bytes), "live wins"


def test_unreadable_gpus_leave_the_declaration(sshd: Sshd, fakebin: FakeBin, tmp_path: Path) -> None:
    fakebin.set_gpus([gpu_row(0, temp="[Unknown Error]")[:10]])  # a row that is not the query's fields
    try:
        with sshd.host() as host:
            machine = live(host, str(tmp_path), "127.0.0.1")
    finally:
        fakebin.reset()
    assert machine.gpus == 0 and machine.gpu_bytes is None
    filled = combined(machine, declared(MachineConfig(gpu="H100", gpus=8)))
    assert (filled.gpus, filled.gpu_name) == (8, "H100")
    assert filled.source.startswith("GPUs declared in machine: (none found live)")


def test_kimi_shaped_checkpoint_from_its_headers(kimi_checkpoint: Path) -> None:
    weights = read_weights(kimi_checkpoint)
    assert weights.basis == "headers"
    files = sum(p.stat().st_size for p in kimi_checkpoint.glob("*.safetensors"))
    assert 0.95 * files < weights.total_bytes <= files, "tensor bytes are the files less their headers"
    replicated = [m.name for m in weights.modules if m.split == "replicated"]
    assert any(name.endswith("self_attn.kv_a_proj_with_mqa") for name in replicated)
    assert any(name.endswith("self_attn.q_a_proj") for name in replicated)
    assert weights.per_gpu_bytes(1) > weights.per_gpu_bytes(8) > weights.per_gpu_bytes(1) / 8
