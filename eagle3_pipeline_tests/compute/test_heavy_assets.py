"""The real heavy assets, materialized with ``compute: ssh`` and ``compute: command`` against the
loopback sshd (the "GPU host" is this machine; the scripted nvidia-smi stands in for its GPUs, the
tiny SmolLM2 model for the target): logs of the remote worker in the run, outputs left under the
host's artifacts root, only the store's index and manifest (or the export's config.json) fetched,
and the asset's checks evaluated from the metadata that came back."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from eagle3_pipeline.components.eagle3.eagle3_drafter import build_drafter_assets
from eagle3_pipeline.components.eagle3.hidden_states import build_eagle3_assets
from eagle3_pipeline.drafter.spec import drafter_paths
from eagle3_pipeline.hidden_states.store import StoreManifest
from eagle3_pipeline.testing.sshd_fixture import FakeBin, Sshd
from eagle3_pipeline.testing.tiny_store import random_store, random_target
from eagle3_pipeline.testing.training_data import tokenized_training_data
from eagle3_pipeline_tests.compute.pipelines import Layout, idle_gpu_rows, ssh_compute
from eagle3_pipeline_tests.dagster_runs import checks, materialize, run_log
from eagle3_pipeline_tests.pipeline_files import load_pipeline

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STORE_FILES = ["index.parquet", "manifest.json"]
HIDDEN_STATES = {"shard_tokens": 24, "spot_check_samples": 1, "device": "cpu"}


def states_config(folder: Path, sshd: Sshd, layout: Layout, model: Path, **compute: Any) -> Any:
    folder.mkdir(parents=True, exist_ok=True)
    config = load_pipeline(
        folder,
        ssh_compute(folder, sshd, layout, **compute),
        {"hidden_states": {**HIDDEN_STATES, "model": str(model)}},
        runtime_checks=True,
    )
    tokenized_training_data(layout.local / "training_data", model)
    return config


def store_identity(root: Path) -> dict[str, Any]:
    return StoreManifest.from_json((root / "hidden_states" / "manifest.json").read_text(), "test").identity()


@pytest.mark.local_model
def test_hidden_states_over_ssh_extract_on_the_host_and_fetch_only_the_index(
    tmp_path: Path, sshd: Sshd, idle_gpus: Any, layout: Layout, local_model: Path
) -> None:
    config = states_config(tmp_path, sshd, layout, local_model)
    instance, result = materialize(build_eagle3_assets(config), ["hidden_states"], config)
    assert result.success
    lines = run_log(instance, result.run_id)
    remote = [m for m in lines if m.startswith("extract:") or m.startswith("GPU check")]
    print("\n-- the remote worker's lines in the run log:", *remote, sep="\n   ")
    assert any(m.startswith("extract: wrote shard-00000") for m in lines)
    assert any(m.startswith("extract: spot check of 1 samples") for m in lines)
    # The embedded server, started by the preflight, answered for the 4 rows; the host validated against it.
    assert checks(result) == {
        "spot_check": (True, "ERROR"),
        "serving_agreement": (True, "ERROR"),
        "bytes_per_token": (True, "ERROR"),
    }
    assert any(m.startswith("extract: validated against http://127.0.0.1") for m in lines)

    metadata: dict[str, Any] = {
        k: v.value for k, v in result.asset_materializations_for_node("hidden_states")[0].metadata.items()
    }
    assert metadata["compute"] == "ssh" and metadata["store"] == str(layout.remote / "hidden_states")
    assert (
        metadata["samples"] == 4 and metadata["shipped_files"] == 4
    )  # train, eval, manifest.json, serving_reference.json
    assert (
        metadata["serving_reference_status"].startswith("recorded from http://127.0.0.1")
        and metadata["serving_samples"] == 4
    )
    observed = [
        e.asset_observation_data.asset_observation.metadata
        for e in result.all_events
        if e.event_type_value == "ASSET_OBSERVATION"
    ]
    assert observed and observed[-1]["shards_done"].value == observed[-1]["shards_total"].value

    local_files = sorted(p.name for p in (layout.local / "hidden_states").iterdir())
    remote_files = sorted(p.name for p in (layout.remote / "hidden_states").iterdir())
    print("-- local:", local_files, "\n-- host:", remote_files)
    assert local_files == STORE_FILES
    assert "shard-00000.safetensors" in remote_files and "shards.json" in remote_files
    assert (layout.local / "hidden_states" / "index.parquet").read_bytes() == (
        layout.remote / "hidden_states" / "index.parquet"
    ).read_bytes()


@pytest.mark.local_model
def test_hidden_states_from_a_command_carry_the_identity_extraction_records(
    tmp_path: Path, sshd: Sshd, idle_gpus: Any, layout: Layout, local_model: Path
) -> None:
    command = (
        f"PYTHONPATH={shlex.quote(str(REPO))} "
        "{python} -m eagle3_pipeline_tests.compute.specforge_command {spec} {output_dir}"
    )
    config = states_config(tmp_path, sshd, layout, local_model, kind="command", command=command)
    instance, result = materialize(build_eagle3_assets(config), ["hidden_states"], config)
    assert result.success
    lines = run_log(instance, result.run_id)
    assert [m for m in lines if m.startswith("[command]")] == [
        f"[command] wrote 4 samples to {layout.remote / 'specforge'}/"
        + Path(str(result.asset_materializations_for_node("hidden_states")[0].metadata["command_output"].value)).name
    ]
    evaluated = checks(result)
    print("\n-- checks:", evaluated)
    assert evaluated == {
        "spot_check": (False, "WARN"),
        "serving_agreement": (False, "WARN"),
        "bytes_per_token": (True, "ERROR"),
    }
    assert sorted(p.name for p in (layout.local / "hidden_states").iterdir()) == STORE_FILES

    reference = Layout(local=tmp_path / "reference", remote=layout.remote, workdir=layout.workdir)
    local_config = states_config(tmp_path / "reference_pipeline", sshd, reference, local_model, kind="local")
    _, extracted = materialize(build_eagle3_assets(local_config), ["hidden_states"], local_config)
    assert extracted.success
    imported, ours = store_identity(layout.local), store_identity(reference.local)
    print("-- identity of the imported store:", json.dumps(imported, indent=1))
    assert imported == ours


def test_drafter_trains_on_the_host_and_leaves_its_export_there(
    tmp_path: Path, sshd: Sshd, idle_gpus: Any, layout: Layout
) -> None:
    target = random_target(tmp_path / "target")  # a host path (the host is this machine)
    drafter = {
        "target_weights": str(target),
        "ttt_steps": 2,
        "epochs": 1,
        "max_steps": 2,
        "batch_tokens": 96,
        "max_seq_len": 32,
        "log_every": 1,
        "checkpoint_every": 2,
        "nproc_per_node": 1,
    }
    config = load_pipeline(tmp_path, ssh_compute(tmp_path, sshd, layout), {"drafter": drafter}, runtime_checks=True)
    remote = drafter_paths(layout.remote)
    random_store(
        remote["store"], drafter_paths(layout.local)["draft_vocab"], target_dir=target, samples=8, draft_vocab_size=40
    )
    instance, result = materialize(build_drafter_assets(config), ["eagle3_drafter"], config)
    assert result.success
    metadata = {k: v.value for k, v in result.asset_materializations_for_node("eagle3_drafter")[0].metadata.items()}
    print(
        "\n-- drafter metadata:",
        {k: metadata[k] for k in ("steps", "first_loss", "last_loss", "compute", "export_dir")},
    )
    assert metadata["compute"] == "ssh" and metadata["steps"] == 2
    assert metadata["export_dir"] == str(remote["export_dir"])
    assert (remote["export_dir"] / "model.safetensors").is_file()
    assert sorted(
        str(p.relative_to(layout.local))
        for p in layout.local.rglob("*")
        if p.is_file() and "draft_vocab" not in p.parts
    ) == ["drafter/export/config.json", "drafter/run/tau_curve.json"]
    assert json.loads((drafter_paths(layout.local)["run_dir"] / "tau_curve.json").read_text()) == metadata["tau_curve"]
    assert any(m.startswith("progress:") for m in run_log(instance, result.run_id))


def test_drafter_on_a_host_with_two_gpus_trains_under_torchrun(
    tmp_path: Path, sshd: Sshd, fakebin: FakeBin, layout: Layout
) -> None:
    """nvidia-smi on the host reports two GPUs and `nproc_per_node` is auto: the worker runs under
    torchrun with two ranks (gloo on this CPU host: no real multi-GPU NCCL run happens here). The
    host's python is a script that records its command line and then runs this venv's python."""
    fakebin.reset()
    fakebin.set_gpus(idle_gpu_rows(2))
    argv_log = tmp_path / "argv.log"
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$*" >> {shlex.quote(str(argv_log))}\nexec {shlex.quote(sys.executable)} "$@"\n'
    )
    python.chmod(0o755)
    target = random_target(tmp_path / "target")
    drafter = {
        "target_weights": str(target),
        "ttt_steps": 2,
        "max_steps": 3,
        "batch_tokens": 96,
        "max_seq_len": 32,
        "log_every": 1,
        "checkpoint_every": 2,
    }
    config = load_pipeline(
        tmp_path, ssh_compute(tmp_path, sshd, layout, python=str(python)), {"drafter": drafter}, runtime_checks=True
    )
    assert config.drafter.nproc_per_node == "auto"
    random_store(
        drafter_paths(layout.remote)["store"],
        drafter_paths(layout.local)["draft_vocab"],
        target_dir=target,
        samples=12,
        draft_vocab_size=40,
    )
    try:
        instance, result = materialize(build_drafter_assets(config), ["eagle3_drafter"], config)
    finally:
        fakebin.reset()
    assert result.success
    seen = argv_log.read_text().splitlines()
    print("\n-- the host ran:", *seen, sep="\n   ")
    assert seen == [
        "-m torch.distributed.run --standalone --nproc_per_node 2 -m eagle3_pipeline.worker train --spec spec.json"
    ]
    metadata = {k: v.value for k, v in result.asset_materializations_for_node("eagle3_drafter")[0].metadata.items()}
    assert metadata["processes"] == 2 and metadata["steps"] == 3 and metadata["compute"] == "ssh"
    assert (drafter_paths(layout.remote)["export_dir"] / "model.safetensors").is_file()
    lines = run_log(instance, result.run_id)
    assert f"running train on 127.0.0.1:{sshd.port} in 2 processes (torchrun)" in lines
    assert any(m.startswith("training a new drafter") and "2 processes" in m for m in lines)
    (messages,) = list(layout.workdir.glob("runs/*-train-*/messages.jsonl"))
    methods = [json.loads(line)["method"] for line in messages.read_text().splitlines()]
    assert methods.count("opened") == 1 and methods.count("report_asset_materialization") == 1  # rank 0 alone reports
