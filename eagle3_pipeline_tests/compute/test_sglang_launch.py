"""The real ``hidden_states`` asset with ``backend: sglang`` on the "GPU host" (the loopback sshd;
the scripted nvidia-smi stands in for its GPUs): the worker starts under torchrun with
``tp_size`` ranks and ``sglang_python``, and the refusals name the setting to change.

``sglang_python`` here is a script that runs this venv's python with a stand-in for SGLang's
CUDA runtime on ``PYTHONPATH`` (``eagle3_pipeline_tests/hidden_states/sglang_standin``, one per
supported release: no GPU and no sglang on this machine), as a host's SGLang venv python would run
the real one: 0.5.23 (the current line) for the two torchrun ranks, 0.5.14 for the local process.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.components.eagle3.hidden_states import build_eagle3_assets
from eagle3_pipeline.config import ConfigError, load_config
from eagle3_pipeline.hidden_states.extract import run
from eagle3_pipeline.testing.extract_specs import transformers_spec
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.sshd_fixture import Sshd
from eagle3_pipeline.testing.stores import assert_same_store
from eagle3_pipeline.testing.training_data import tokenized_training_data
from eagle3_pipeline_tests.compute.pipelines import Layout, ssh_compute
from eagle3_pipeline_tests.dagster_runs import checks, materialize, pipeline_resources, run_log
from eagle3_pipeline_tests.hidden_states.sglang_standins import standin_pythonpath
from eagle3_pipeline_tests.pipeline_files import load_pipeline, write_pipeline

# These tests start worker processes (torchrun ranks, a wrapper shell): the modules that read the
# process table take turns with them (root conftest `process_table`).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("process_table")]
REPO = Path(__file__).resolve().parents[2]
# mem_fraction_static set: the stand-in's machine has no GPU, so auto could not be chosen (the preflight says so)
SGLANG = {
    "backend": "sglang", "shard_tokens": 24, "spot_check_samples": 1, "batch_tokens": 64, "max_batch_size": 4,
    "mem_fraction_static": 0.75,
}  # fmt: skip


def sglang_venv_python(folder: Path, version: str) -> Path:
    """What ``hidden_states.sglang_python`` points at: here, this venv's python with the stand-in of
    SGLang ``version`` and this checkout's package (over SSH the caller's PYTHONPATH is not passed)."""
    path = folder / "serving-venv" / "bin" / "python"
    path.parent.mkdir(parents=True)
    stand_in = os.pathsep.join([standin_pythonpath(version), str(REPO)])
    path.write_text(f'#!/bin/sh\nPYTHONPATH={stand_in}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return path


def refusal(config: Any) -> str:
    """The failure of materializing ``hidden_states`` under ``config``."""
    result = dg.materialize(
        build_eagle3_assets(config),
        selection=["hidden_states"],
        instance=dg.DagsterInstance.ephemeral(),
        resources=pipeline_resources(config.source_file),
        raise_on_error=False,
    )
    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    error = failure.step_failure_data.error
    assert error is not None
    return error.cause.message if error.cause else error.message


@pytest.mark.local_model
def test_extraction_runs_under_torchrun_with_the_sglang_python_and_writes_the_extractors_bytes(
    tmp_path: Path, sshd: Sshd, idle_gpus: Any, layout: Layout, local_model: Path
) -> None:
    python = sglang_venv_python(tmp_path, "0.5.23")
    settings = {**SGLANG, "model": str(local_model), "sglang_python": str(python), "tp_size": 2}
    config = load_pipeline(
        tmp_path, ssh_compute(tmp_path, sshd, layout), {"hidden_states": settings}, runtime_checks=True
    )
    tokenized_training_data(layout.local / "training_data", local_model)
    instance, result = materialize(build_eagle3_assets(config), ["hidden_states"], config)
    assert result.success
    lines = run_log(instance, result.run_id)
    print(
        "\n-- run log:", *[m for m in lines if m.startswith(("GPU check", "running extract", "extract:"))], sep="\n   "
    )
    assert any(re.fullmatch(r"GPU check: 8 of 8 GPU\(s\) free on 127\.0\.0\.1:\d+, 2 needed", m) for m in lines)
    assert any(re.fullmatch(r"running extract on 127\.0\.0\.1:\d+ in 2 processes \(torchrun\)", m) for m in lines)
    assert any("with SGLang 0.5.23 ModelRunner, tensor parallelism 2" in m for m in lines)
    # Both ranks computed the reference samples, rank 0 compared them with the embedded server's answers.
    assert checks(result) == {
        "spot_check": (True, "ERROR"),
        "serving_agreement": (True, "ERROR"),
        "bytes_per_token": (True, "ERROR"),
    }
    metadata: dict[str, Any] = {
        k: v.value for k, v in result.asset_materializations_for_node("hidden_states")[0].metadata.items()
    }
    assert metadata["backend"] == "sglang" and metadata["capture"]["tp_size"] == 2 and metadata["compute"] == "ssh"

    # torchrun starts its ranks with OMP_NUM_THREADS=1; CPU matmuls reduce in another order with
    # more threads, so the reference runs on one thread too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = tmp_path / "transformers"
        run(
            transformers_spec(
                layout.local / "training_data",
                reference,
                local_model,
                config.target.model,
                shard_tokens=24,
                spot_check_samples=0,
            ),
            Recorder(),
        )
    finally:
        torch.set_num_threads(threads)
    figures = assert_same_store(layout.remote / "hidden_states", reference)
    print(f"-- the host's store (2 ranks, rank 0 writing) is the transformers extractor's: {figures}")


@pytest.mark.local_model
def test_local_compute_starts_the_worker_with_the_sglang_python(
    tmp_path: Path, sshd: Sshd, layout: Layout, local_model: Path
) -> None:
    """``compute: local``: the worker is a local Pipes subprocess of ``sglang_python`` (the Dagster
    process's own venv has no SGLang), even with one rank."""
    python = sglang_venv_python(tmp_path, "0.5.14")
    settings = {**SGLANG, "model": str(local_model), "sglang_python": str(python), "tp_size": 1}
    config = load_pipeline(
        tmp_path, ssh_compute(tmp_path, sshd, layout, kind="local"), {"hidden_states": settings}, runtime_checks=True
    )
    tokenized_training_data(layout.local / "training_data", local_model)
    instance, result = materialize(build_eagle3_assets(config), ["hidden_states"], config)
    assert result.success
    lines = run_log(instance, result.run_id)
    [launch] = [m for m in lines if m.startswith("running extract in 1 local process: ")]
    print("\n--", launch)
    assert launch.split(": ", 1)[1].startswith(f"{python} -m eagle3_pipeline.worker extract --spec ")
    metadata: dict[str, Any] = {
        k: v.value for k, v in result.asset_materializations_for_node("hidden_states")[0].metadata.items()
    }
    assert (
        metadata["compute"] == "local"
        and metadata["capture"]["model_class"] == "LlamaForCausalLM"
        and metadata["capture"]["sglang_version"] == "0.5.14"
        and metadata["samples"] == 4
    )


def test_busy_gpus_refuse_naming_tp_size(tmp_path: Path, sshd: Sshd, fakebin: Any, layout: Layout) -> None:
    fakebin.reset()  # the scripted nvidia-smi: 8 GPUs with 130000 MiB in use (the SGLang server still holds them)
    settings = {**SGLANG, "model": "/models/kimi", "sglang_python": "/opt/sglang/bin/python", "tp_size": 8}
    config = load_pipeline(
        tmp_path, ssh_compute(tmp_path, sshd, layout), {"hidden_states": settings}, runtime_checks=True
    )
    text = refusal(config)
    print("\n-- the refusal:", text)
    assert re.search(
        r"0 of 8 GPU\(s\) on 127\.0\.0\.1:\d+ are free \(< 1024 MiB used, compute\.gpu_free_memory_mib\), 8 "
        r"needed \(hidden_states\.tp_size\)",
        text,
    )
    assert "stop the inference server holding them first" in text
    assert not layout.workdir.exists()


def test_a_missing_sglang_python_on_the_host_is_named(
    tmp_path: Path, sshd: Sshd, idle_gpus: Any, layout: Layout
) -> None:
    settings = {
        **SGLANG,
        "model": "/models/kimi",
        "sglang_python": str(tmp_path / "no-venv" / "bin" / "python"),
        "tp_size": 2,
    }
    config = load_pipeline(
        tmp_path, ssh_compute(tmp_path, sshd, layout), {"hidden_states": settings}, runtime_checks=True
    )
    text = refusal(config)
    print("\n-- the refusal:", text)
    assert (
        f"hidden_states.sglang_python: '{tmp_path / 'no-venv' / 'bin' / 'python'}' is not an executable on 127.0.0.1"
        in text
    )
    assert not (layout.workdir / "runs").exists()


def test_backend_sglang_without_its_python_is_a_config_error(tmp_path: Path) -> None:
    def pipeline(hidden_states: dict[str, Any]) -> Path:
        target = {"model": "m", "tokenizer": None}
        return write_pipeline(
            tmp_path, {"artifacts_root": str(tmp_path), "target": target, "hidden_states": hidden_states}
        )

    with pytest.raises(ConfigError, match=r"hidden_states: .*backend 'sglang' needs hidden_states.sglang_python"):
        load_config(pipeline({"backend": "sglang"}))
    with pytest.raises(ConfigError, match=r"device 'cpu' is for backend 'transformers'"):
        load_config(pipeline({"backend": "sglang", "sglang_python": "python3", "device": "cpu"}))
