"""The CUDA toolchain check of ``benchmarks/gpu_check.py`` (``benchmarks/cuda_toolchain.py``): what FlashInfer/
DeepGEMM JIT would find in an environment, with a script standing in for ``nvcc`` (no CUDA on this machine)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.cuda_toolchain import toolchain


def cuda_folder(root: Path, release: str = "12.8") -> Path:
    """A CUDA_HOME whose bin/nvcc prints ``nvcc --version``'s release line."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.93'\n")
    nvcc.chmod(0o755)
    return root


def test_a_complete_toolchain_is_ready_for_jit(tmp_path: Path) -> None:
    cuda = cuda_folder(tmp_path / "cuda")
    found = toolchain({"CUDA_HOME": str(cuda), "PATH": f"{cuda}/bin:/usr/bin"}, torch_cuda="12.8")
    assert found["ready_for_jit"] and found["problems"] == []
    assert found["nvcc"] == str(cuda / "bin" / "nvcc") and found["nvcc_release"] == "12.8"


def test_a_non_login_shell_without_cuda_says_what_is_missing() -> None:
    found = toolchain({"PATH": "/usr/bin:/bin"}, torch_cuda="12.8")
    assert not found["ready_for_jit"]
    assert found["problems"] == ["CUDA_HOME (or CUDA_PATH) is not set", "nvcc is not on PATH"]


def test_an_nvcc_of_another_major_than_torchs_is_named(tmp_path: Path) -> None:
    cuda = cuda_folder(tmp_path / "cuda", release="11.8")
    found = toolchain({"CUDA_HOME": str(cuda), "PATH": "/usr/bin"}, torch_cuda="12.8")
    assert found["problems"] == ["nvcc is not on PATH", "nvcc 11.8 and torch's CUDA 12.8 differ in their major version"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert toolchain({"CUDA_HOME": str(empty), "PATH": ""})["problems"][0] == f"CUDA_HOME={empty} has no bin/nvcc"
