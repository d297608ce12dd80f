"""`compute: local` in a real Dagster run, the worker run by hand, and the `compute:` settings."""

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_pipeline.compute.remote import RemoteRun
from eagle3_pipeline.config import ConfigError, HostConfig
from eagle3_pipeline.hosts import SshHost, build_host
from eagle3_pipeline.orchestration.heavy_phase import run_heavy_phase
from eagle3_pipeline_tests.hidden_states.specforge_files import import_spec, make_samples, write_specforge
from eagle3_pipeline_tests.pipeline_files import load_pipeline

torch = pytest.importorskip("torch")


def ssh_host(settings: HostConfig) -> SshHost:
    """The SSH host a compute section names (nothing connects before a command runs)."""
    host = build_host(settings)
    assert isinstance(host, SshHost)
    return host


def test_local_kind_runs_in_process_with_logs_and_observations(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, runtime_checks=True)
    sf = write_specforge(config.artifacts_root / "specforge_in", make_samples(6))
    spec = import_spec(sf, config.artifacts_root / "hidden_states", None, per_shard=4)

    @dg.asset(name="hidden_states")
    def hidden_states(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        return dg.MaterializeResult(
            metadata=run_heavy_phase(
                context, config.compute, artifacts_root=config.artifacts_root, phase="import-specforge", spec=spec
            )
        )

    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize([hidden_states], instance=instance)
    assert result.success
    lines = [entry.user_message for entry in instance.all_logs(result.run_id)]
    assert any(m.startswith("importing 6 SpecForge samples") for m in lines)
    assert [o.metadata["shards_done"].value for o in result.asset_observations_for_node("hidden_states")] == [1, 2]
    [materialization] = result.asset_materializations_for_node("hidden_states")
    assert materialization.metadata["compute"].value == "local" and materialization.metadata["samples"].value == 6


@pytest.mark.slow
def test_worker_by_hand_prints_metadata_and_refuses_a_bad_spec(tmp_path: Path) -> None:
    sf = write_specforge(tmp_path / "sf", make_samples(3))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(import_spec(sf, tmp_path / "store", None)))
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_pipeline.worker", "import-specforge", "--spec", str(spec)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["samples"] == 3
    assert "progress: shards_done=1, shards_total=1" in done.stderr

    spec.write_text("[1, 2]")
    bad = subprocess.run(
        [sys.executable, "-m", "eagle3_pipeline.worker", "import-specforge", "--spec", str(spec)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and f"{spec}: expected a JSON object, got list" in bad.stderr
    unknown = subprocess.run(
        [sys.executable, "-m", "eagle3_pipeline.worker", "nope", "--spec", str(spec)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unknown.returncode == 2 and "unknown phase 'nope'" in unknown.stderr


@pytest.mark.parametrize(
    ("compute", "message"),
    [
        (
            {"kind": "ssh", "host": {"hostname": "gpu-box"}},
            "compute: Value error, kind 'ssh' needs compute.workdir and compute.artifacts_root",
        ),
        ({"kind": "ssh", "workdir": "/w", "artifacts_root": "/a"}, "needs compute.host with a hostname"),
        (
            {"kind": "command", "host": {"hostname": "h"}, "workdir": "/w", "artifacts_root": "/a"},
            "kind 'command' needs compute.command",
        ),
        (
            {
                "kind": "command",
                "host": {"hostname": "h"},
                "workdir": "/w",
                "artifacts_root": "/a",
                "command": "run {out}",
            },
            "compute.command: Value error, unknown placeholder(s) ['out']",
        ),
        (
            {"kind": "ssh", "host": {"hostname": "h"}, "workdir": "relative", "artifacts_root": "/a"},
            "compute.workdir: String should match pattern '^/'",
        ),
    ],
)
def test_bad_compute_settings_name_the_field(tmp_path: Path, compute: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_pipeline(tmp_path, {"compute": compute}, runtime_checks=True)
    assert message in str(error.value)


def test_paths_map_onto_the_host_and_command_values_are_quoted(tmp_path: Path) -> None:
    compute = {
        "kind": "command",
        "host": {"hostname": "gpu-box"},
        "workdir": "/data/work",
        "artifacts_root": "/data/eagle3",
        "command": "prep --out {output_dir} --python {python}",
        "python": "/opt/py 3/bin/python",
    }
    config = load_pipeline(tmp_path, {"compute": compute}, runtime_checks=True)
    assert config.compute.host.kind == "ssh"
    remote = RemoteRun(ssh_host(config.compute.host), config.compute, config.artifacts_root, "run1", "extract")
    root = str(config.artifacts_root)
    spec = {
        "output_dir": f"{root}/hidden_states",
        "shards": [f"{root}/training_data/train-00000.parquet"],
        "model": "/models/kimi",
        "n": 3,
    }
    assert remote.translate(spec) == {
        "output_dir": "/data/eagle3/hidden_states",
        "shards": ["/data/eagle3/training_data/train-00000.parquet"],
        "model": "/models/kimi",
        "n": 3,
    }
    command = remote.user_command(config.compute.command or "", "/data/eagle3/specforge/x; rm -rf /")
    assert shlex.split(command) == [
        "prep",
        "--out",
        "/data/eagle3/specforge/x; rm -rf /",
        "--python",
        "/opt/py 3/bin/python",
    ]
    env = {"DAGSTER_PIPES_CONTEXT": "abc=", "DAGSTER_PIPES_MESSAGES": "x y"}
    assert shlex.split(remote.worker_command("extract", "python3", env)) == [
        "env",
        "DAGSTER_PIPES_CONTEXT=abc=",
        "DAGSTER_PIPES_MESSAGES=x y",
        "python3",
        "-m",
        "eagle3_pipeline.worker",
        "extract",
        "--spec",
        "spec.json",
    ]
    torchrun = remote.worker_command("train", "/opt/py 3/bin/python", env, processes=4)
    assert shlex.split(torchrun)[3:] == [
        "/opt/py 3/bin/python",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "4",
        "-m",
        "eagle3_pipeline.worker",
        "train",
        "--spec",
        "spec.json",
    ]


def test_a_gpu_host_needs_the_targets_folder_there(tmp_path: Path) -> None:
    """The embedded model's folder is a path on this machine: with a GPU host, hidden_states.model
    and drafter.target_weights must name the target's folder on the host, and the train spec's
    paths are local ones under the artifacts root (run_heavy_phase maps them onto the host's)."""
    from eagle3_pipeline.drafter.spec import DrafterSpecError, train_spec
    from eagle3_pipeline.hidden_states.extract import target_weights
    from eagle3_pipeline.hidden_states.extract_spec import ExtractionError

    compute = {
        "kind": "ssh",
        "host": {"hostname": "gpu-box"},
        "workdir": "/data/work",
        "artifacts_root": "/data/eagle3",
    }
    config = load_pipeline(tmp_path, {"compute": compute}, runtime_checks=True)
    with pytest.raises(ExtractionError, match="hidden_states.model: required with compute.kind 'ssh'"):
        target_weights(config)
    with pytest.raises(DrafterSpecError, match="drafter.target_weights: required with compute.kind 'ssh'"):
        train_spec(config)
    config = config.model_copy(update={"drafter": config.drafter.model_copy(update={"target_weights": "/models/kimi"})})
    remote = RemoteRun(ssh_host(config.compute.host), config.compute, config.artifacts_root, "run1", "train")
    translated = remote.translate(train_spec(config))
    assert {k: translated[k] for k in ("store", "draft_vocab", "run_dir", "export_dir", "target_weights")} == {
        "store": "/data/eagle3/hidden_states",
        "draft_vocab": "/data/eagle3/draft_vocab",
        "run_dir": "/data/eagle3/drafter/run",
        "export_dir": "/data/eagle3/drafter/export",
        "target_weights": "/models/kimi",
    }


@pytest.mark.slow
def test_the_follower_waits_for_a_process_that_has_not_made_its_group_yet(tmp_path: Path) -> None:
    """The remote follower (run by `sh` here, as the host runs it) follows a process until its group
    is gone. A process just started may not have made its own group yet; the follower must not take
    that for its end (it did under load: the run failed with the worker still running)."""
    from eagle3_pipeline.compute.remote import _tail

    (tmp_path / "messages.jsonl").write_text("")
    late = "sleep 0.6; exec setsid sh -c 'echo late line >> messages.jsonl; echo 0 > worker.status'"
    subprocess.run(
        ["sh", "-c", f"( sh -c {shlex.quote(late)} </dev/null >/dev/null 2>&1 & echo $! > worker.pid )"],
        cwd=tmp_path,
        check=True,
    )
    followed = subprocess.run(
        ["sh", "-c", _tail("worker", "messages.jsonl", 0)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert "late line" in followed.stdout
    assert (tmp_path / "worker.status").read_text().strip() == "0"
