"""The engine's CUDA toolchain as the server's environment has it: FlashInfer and DeepGEMM compile kernels at run
time (JIT) with ``nvcc``, found through ``CUDA_HOME`` (or ``CUDA_PATH``) or on ``PATH``; a server started in a
shell without them fails at its first JIT build, often well into a 1T model's load. ``gpu_check`` prints this
section first (``--toolchain`` alone); run it in the environment the managed server gets (docs/operations.md,
"The server's environment"): the same SSH login or not (``serving.login_shell``), the same ``serving.env_file``.

:func:`toolchain` reports, without raising: ``CUDA_HOME``, the ``nvcc`` it would use and its release, the CUDA
torch was built with, and ``problems``: what is missing or does not match (an empty list: ready for JIT).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RELEASE = re.compile(r"release (\d+\.\d+)")


def nvcc_release(nvcc: str) -> str | None:
    """``12.8`` from ``nvcc --version`` (None: it does not run or prints no release)."""
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = RELEASE.search(done.stdout)
    return found.group(1) if done.returncode == 0 and found else None


def toolchain(env: Mapping[str, str] | None = None, torch_cuda: str | None = None) -> dict[str, Any]:
    """The figures of this environment's CUDA toolchain (module doc); ``torch_cuda``: ``torch.version.cuda``
    (None on a CPU build: no match is asked for)."""
    env = os.environ if env is None else env
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    problems: list[str] = []
    home_nvcc = Path(home) / "bin" / "nvcc" if home else None
    if not home:
        problems.append("CUDA_HOME (or CUDA_PATH) is not set")
    elif home_nvcc is None or not home_nvcc.is_file():
        problems.append(f"CUDA_HOME={home} has no bin/nvcc")
    on_path = shutil.which("nvcc", path=env.get("PATH", ""))
    if on_path is None:
        problems.append("nvcc is not on PATH")
    nvcc = str(home_nvcc) if home_nvcc is not None and home_nvcc.is_file() else on_path
    release = nvcc_release(nvcc) if nvcc else None
    if nvcc and release is None:
        problems.append(f"{nvcc} --version reports no release")
    if release and torch_cuda and release.split(".")[0] != torch_cuda.split(".")[0]:
        problems.append(f"nvcc {release} and torch's CUDA {torch_cuda} differ in their major version")
    return {
        "cuda_home": home,
        "nvcc": nvcc,
        "nvcc_on_path": on_path,
        "nvcc_release": release,
        "torch_cuda": torch_cuda,
        "problems": problems,
        "ready_for_jit": not problems,
    }
