"""``benchmarks/gpu_check.py`` (``python -m benchmarks.gpu_check``), the script a session with a lent GPU
runs, kept runnable: its
``--smoke`` mode on this CPU (toy sizes; random-weight models built from configs, the stand-ins for
the target and the drafter, as the script builds them on the GPU), its ``--sglang`` section on each
release's stand-in for SGLang, its time guard and its refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


def run_script(*args: str, path: tuple[Path, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (*path, REPO)), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def sections(stdout: str) -> dict[str, dict[str, Any]]:
    found = [json.loads(line.removeprefix("FIGURES ")) for line in stdout.splitlines() if line.startswith("FIGURES ")]
    return {f.pop("section"): f for f in found}


@pytest.mark.slow
def test_smoke_runs_every_section_and_prints_its_figures() -> None:
    done = run_script("--smoke")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    first = done.stdout.splitlines()[0]
    assert first.startswith("MEASURED ON ")
    machine = json.loads(first.removeprefix("MEASURED ON "))
    assert (
        machine["torch"]
        and machine["transformers"]
        and machine["device"] in ("cpu", "cuda")
        and "bfloat16" in machine["dtype"]
    )
    found = sections(done.stdout)
    assert list(found) == ["toolchain", "chain", "extract", "train-inputs", "train-64", "train-128"], done.stdout[
        -4000:
    ]
    assert not [name for name, values in found.items() if "failed" in values or "skipped" in values], done.stdout[
        -4000:
    ]
    chain = found["chain"]
    # float32: the chain drafting equals the unrolled pass (as in drafter/model/test_eagle3.py);
    # bf16 is reported, not judged
    assert max(chain["float32"]["max_rel_error_per_depth"]) < 1e-4
    assert chain["float32"]["same_draft_token_share_per_depth"] == [1.0] * chain["steps"]
    assert len(chain["bf16"]["max_rel_error_per_depth"]) == chain["steps"]
    for target in ("llama", "kimi_fixture"):
        extracted = found["extract"][target]
        assert (
            extracted["capture_dtype"] == "bfloat16"
            and extracted["spot_check_samples"] == 4
            and extracted["spot_check_passed"]
        )
        assert extracted["tokens"] > 0 and extracted["tokens_per_s"] > 0
    for batch_tokens in (64, 128):
        trained = found[f"train-{batch_tokens}"]
        assert trained["batch_tokens"] == batch_tokens and trained["steps"] == 2
        assert 0 < trained["trained_tokens"] <= 2 * batch_tokens and trained["tokens_per_s"] > 0
        assert trained["draft"]["draft_vocab_size"] == 256


def test_the_time_guard_ends_the_run_and_says_so() -> None:
    done = run_script("--smoke", "--time-limit", "1")
    assert done.returncode == 3, done.stdout[-4000:] + done.stderr[-4000:]
    assert "TIME GUARD: 1 s reached" in done.stdout
    assert "done in" not in done.stdout


def test_without_pydantic_it_says_to_run_it_where_the_project_is_installed(tmp_path: Path) -> None:
    """A python without the project's dependencies: a pydantic that fails to import stands in for it."""
    (tmp_path / "pydantic").mkdir()
    (tmp_path / "pydantic" / "__init__.py").write_text('raise ImportError("no pydantic in this python")\n')
    done = run_script("--smoke", path=(tmp_path,))
    assert done.returncode == 2, done.stdout[-4000:] + done.stderr[-4000:]
    assert "pydantic is missing" in done.stdout and "where this project is installed" in done.stdout
    assert "FIGURES" not in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.5.14", "0.5.23"])
def test_the_sglang_section_runs_on_each_release(version: str) -> None:
    """``--sglang`` with the python of an SGLang venv: here this one with a release's stand-in (CPU,
    float32), so the figures are the script's plumbing, not SGLang's numerics."""
    from eagle3_pipeline_tests.hidden_states.sglang_standins import standin_path

    done = run_script("--sglang", "--smoke", path=tuple(standin_path(version)))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    found = sections(done.stdout)
    assert list(found) == ["toolchain", "sglang"], done.stdout[-4000:]
    sglang = found["sglang"]
    assert sglang["sglang_version"] == version
    for key, model_class, form in (
        ("llama", "LlamaForCausalLM", "list"),
        ("kimi_fixture", "KimiK25ForConditionalGeneration", "list" if version == "0.5.14" else "packed"),
    ):
        result = sglang[key]
        assert result["capture"]["model_class"] == model_class and result["capture"]["aux_form"] == form
        assert result["capture"]["layers_to_capture"] == [2, 4, 5]
        assert result["same_ids_and_samples"] and result["samples"] == 4 and result["within_tolerance"]
        assert result["spot_check_passed"]


def test_the_sglang_section_without_sglang_says_which_python_to_use() -> None:
    done = run_script("--sglang", "--smoke")
    assert done.returncode == 2, done.stdout[-4000:] + done.stderr[-4000:]
    assert "--sglang: hidden_states.sglang_python: cannot import sglang here" in done.stdout
    assert "Run this script with the python of an SGLang venv" in done.stdout
    assert "FIGURES" not in done.stdout


def test_the_toolchain_section_alone_reports_what_jit_would_find(tmp_path: Path) -> None:
    """``--toolchain``: this machine's environment with a CUDA folder whose nvcc is a script standing in for
    the compiler (no CUDA here)."""
    cuda = tmp_path / "cuda-12.8"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    nvcc.chmod(0o755)
    env = {"CUDA_HOME": str(cuda), "PATH": f"{cuda / 'bin'}:{os.environ['PATH']}"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--toolchain"],
        cwd=REPO,
        env={**os.environ, **env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    found = sections(done.stdout)
    assert list(found) == ["toolchain"], done.stdout[-4000:]
    assert found["toolchain"]["nvcc"] == str(nvcc) and found["toolchain"]["nvcc_release"] == "12.8"
