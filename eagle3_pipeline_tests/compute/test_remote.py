"""Heavy phases on the "GPU host" over the real loopback sshd, inside real Dagster runs.

The phase is the real ``import-specforge`` (SpecForge fixture files written here with
``torch.save``). The scripted nvidia-smi stands in for the host's GPUs (there is none here). To
hold the worker mid-phase — for the termination and the dropped-connection tests — one SpecForge
sample on the host is a named pipe: the worker blocks reading it, as on a hung filesystem, until
the test writes a real sample into it.
"""

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.config import load_config
from eagle3_pipeline.hidden_states.store import ShardWriter
from eagle3_pipeline.orchestration.heavy_phase import run_heavy_phase
from eagle3_pipeline.testing.process_tools import wait_until
from eagle3_pipeline.testing.sshd_fixture import Sshd, TcpProxy
from eagle3_pipeline.testing.stores import shard_contents
from eagle3_pipeline_tests.compute.pipelines import Layout, ssh_compute
from eagle3_pipeline_tests.hidden_states.specforge_files import (
    LAYERS,
    TARGET,
    import_spec,
    make_samples,
    write_specforge,
    write_training_data,
)
from eagle3_pipeline_tests.pipeline_files import load_pipeline

REPO = Path(__file__).resolve().parents[2]
INDEX_AND_MANIFEST = ["hidden_states/index.parquet", "hidden_states/manifest.json"]
BLOCKING_IDX = 99


def heavy_asset(
    config_path: Path, phase: str, spec: dict[str, Any], ship: Sequence[str], fetch: Sequence[str]
) -> dg.AssetsDefinition:
    """An asset whose body is what a real heavy asset's is: one ``run_heavy_phase`` call."""

    @dg.asset(name="hidden_states")
    def hidden_states(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        config = load_config(config_path)
        return dg.MaterializeResult(
            metadata=run_heavy_phase(
                context,
                config.compute,
                artifacts_root=config.artifacts_root,
                phase=phase,
                spec=spec,
                ship=ship,
                fetch=fetch,
            )
        )

    return hidden_states


def stage(layout: Layout, samples: list[Any], training: bool = True) -> tuple[dict[str, Any], list[str]]:
    """SpecForge files and training_data under the local artifacts root, the spec, what to ship."""
    sf = write_specforge(layout.local / "specforge_in", samples)
    shards = write_training_data(layout.local / "training_data", samples) if training else None
    ship = [str(sf)] + ([str(layout.local / "training_data")] if training else [])
    return import_spec(sf, layout.local / "hidden_states", shards), ship


def messages(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    return [entry.user_message for entry in instance.all_logs(run_id)]


def worker_processes() -> list[str]:
    """Live (not zombie) processes of a remote worker or its follower, as `ps` shows them."""
    listing = subprocess.run(
        ["ps", "-ww", "-eo", "pid,pgid,stat,args"], capture_output=True, text=True, check=True
    ).stdout
    return [
        line
        for line in listing.splitlines()[1:]
        if ("eagle3_pipeline.worker" in line or "messages.jsonl" in line)
        and line.split()[2][0] != "Z"
        and "ps -eo" not in line
    ]


def block_on_fifo(layout: Layout) -> Path:
    folder = layout.remote / "specforge_in" / "rows_0-2000"
    folder.mkdir(parents=True, exist_ok=True)
    fifo = folder / f"data_{BLOCKING_IDX}.ckpt"
    os.mkfifo(fifo)
    return fifo


def run_dir_messages(layout: Layout) -> str:
    return "".join(p.read_text() for p in (layout.workdir / "runs").glob("*/messages.jsonl"))


def test_phase_over_ssh_reports_into_the_run_and_leaves_outputs_on_the_host(
    tmp_path: Path, sshd: Sshd, idle_gpus: Any, layout: Layout
) -> None:
    config = load_pipeline(tmp_path, ssh_compute(tmp_path, sshd, layout), runtime_checks=True)
    samples = make_samples(10)
    spec, ship = stage(layout, samples)
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize(
        [heavy_asset(config.source_file, "import-specforge", spec, ship, INDEX_AND_MANIFEST)], instance=instance
    )
    assert result.success
    lines = messages(instance, result.run_id)
    remote_lines = [m for m in lines if "SpecForge samples" in m or m.startswith("progress:") or "imported" in m]
    print("\n-- run log lines from the remote worker:", *remote_lines, sep="\n   ")
    assert any(m.startswith("importing 10 SpecForge samples") for m in lines)
    assert any(
        m
        == "progress: shards_done=3, shards_total=3, samples=10, tokens=" + str(sum(len(s.input_ids) for s in samples))
        for m in lines
    )
    assert any(m.startswith("GPU check: 8 of 8 GPU(s) free on 127.0.0.1") for m in lines)
    observations = result.asset_observations_for_node("hidden_states")
    assert [o.metadata["shards_done"].value for o in observations] == [1, 2, 3]

    [materialization] = result.asset_materializations_for_node("hidden_states")
    metadata = {k: v.value for k, v in materialization.metadata.items()}
    print("-- materialization metadata:", json.dumps(metadata, indent=1, default=str), sep="\n")
    assert metadata["samples"] == 10 and metadata["shards"] == 3 and metadata["compute"] == "ssh"
    assert metadata["store"] == str(layout.remote / "hidden_states")
    assert metadata["remote_artifacts_root"] == str(layout.remote)
    assert metadata["shipped_files"] == 12 and metadata["already_there"] == 0

    local = sorted(p.name for p in (layout.local / "hidden_states").iterdir())
    remote = sorted(p.name for p in (layout.remote / "hidden_states").iterdir())
    print("-- local artifacts/hidden_states:", local, "\n-- remote artifacts/hidden_states:", remote)
    assert local == ["index.parquet", "manifest.json"]
    assert "shard-00002.safetensors" in remote and len(remote) == 2 + 2 * 3
    assert (layout.local / "hidden_states" / "index.parquet").read_bytes() == (
        layout.remote / "hidden_states" / "index.parquet"
    ).read_bytes()

    again = dg.materialize(
        [heavy_asset(config.source_file, "import-specforge", spec, ship, INDEX_AND_MANIFEST)], instance=instance
    )
    [second] = again.asset_materializations_for_node("hidden_states")
    assert second.metadata["already_there"].value == 12 and second.metadata["shipped_files"].value == 0
    assert second.metadata["shards_skipped"].value == 3


def test_busy_gpus_refuse_before_anything_starts(tmp_path: Path, sshd: Sshd, fakebin: Any, layout: Layout) -> None:
    fakebin.reset()  # the scripted nvidia-smi: 8 GPUs with 130000 MiB in use (a server holds them)
    config = load_pipeline(tmp_path, ssh_compute(tmp_path, sshd, layout), runtime_checks=True)
    spec, ship = stage(layout, make_samples(2))
    result = dg.materialize(
        [heavy_asset(config.source_file, "import-specforge", spec, ship, INDEX_AND_MANIFEST)], raise_on_error=False
    )
    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    error = failure.step_failure_data.error
    assert error is not None
    text = error.cause.message if error.cause else error.message
    print("\n-- the refusal:", text)
    assert "0 of 8 GPU(s) on 127.0.0.1" in text and "2 needed" in text and "GPU 0: 130000.0 MiB used" in text
    assert not layout.workdir.exists()


def materialize_in_this_process(config_path: str, spec_path: str) -> None:
    """The run of the termination test, in its own process (``python -c``) so the test can
    interrupt it as Dagster's run termination does (SIGINT to the run's process)."""
    staged = json.loads(Path(spec_path).read_text())
    dg.materialize(
        [heavy_asset(Path(config_path), "import-specforge", staged["spec"], staged["ship"], INDEX_AND_MANIFEST)],
        instance=dg.DagsterInstance.get(),
        raise_on_error=False,
    )


@pytest.mark.slow
def test_terminated_run_leaves_no_remote_process(
    tmp_path: Path, sshd: Sshd, idle_gpus: Any, layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    config = load_pipeline(tmp_path, ssh_compute(tmp_path, sshd, layout), runtime_checks=True)
    spec, ship = stage(layout, make_samples(10), training=False)
    block_on_fifo(layout)
    staged = tmp_path / "staged.json"
    staged.write_text(json.dumps({"spec": spec, "ship": ship}))
    code = (
        "import sys; from eagle3_pipeline_tests.compute.test_remote import materialize_in_this_process as m; "
        "m(sys.argv[1], sys.argv[2])"
    )
    run = subprocess.Popen([sys.executable, "-c", code, str(config.source_file), str(staged)], cwd=REPO)
    try:
        wait_until(
            lambda: "shards_done=2" in run_dir_messages(layout), 90, "the remote worker blocked in its third shard"
        )
        before = worker_processes()
        print("\n-- remote processes while the run is in flight:", *before, sep="\n   ")
        assert any("eagle3_pipeline.worker import-specforge" in line for line in before)
        instance = dg.DagsterInstance.get()
        [in_flight] = instance.get_runs()
        instance.report_run_canceling(
            in_flight
        )  # what Dagster's run termination does, then it interrupts the run process
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=60) == 0
    finally:
        if run.poll() is None:
            run.kill()
    wait_until(lambda: not worker_processes(), 10, "no remote worker or follower left")
    print("-- remote processes after the run was terminated:", worker_processes() or "none")
    [record] = instance.get_run_records()
    lines = messages(instance, record.dagster_run.run_id)
    killed = [m for m in lines if m.startswith("step stopped: killed the remote worker")]
    print("-- run status:", record.dagster_run.status, *killed, sep="\n   ")
    assert record.dagster_run.status == dg.DagsterRunStatus.CANCELED
    assert killed and "gone without an exit status" in killed[0]
    [run_dir] = (layout.workdir / "runs").iterdir()
    assert not (run_dir / "worker.status").exists()


def sample_bytes(seed: int) -> bytes:
    [sample] = make_samples(1, seed=seed)
    buffer = io.BytesIO()
    torch.save(
        {
            "input_ids": sample.input_ids,
            "loss_mask": sample.loss_mask,
            "aux_hidden_state": sample.aux[None],
            "hidden_state": sample.hidden[None],
        },
        buffer,
    )
    return buffer.getvalue()


@pytest.mark.parametrize("fault", ["cut", "freeze"])
@pytest.mark.slow
def test_dropped_connection_reports_the_workers_fate_and_follows_it_to_the_end(
    tmp_path: Path, sshd: Sshd, idle_gpus: Any, layout: Layout, fault: str
) -> None:
    """``cut``: the link is reset (a dead router, a rebooted NAT). ``freeze``: it goes silent
    without a reset, detected by the follower's missing heartbeat."""
    proxy = TcpProxy(sshd.port)
    known_hosts = tmp_path / "known_hosts_proxy"
    key = sshd.known_hosts.read_text().split(maxsplit=1)[1]
    known_hosts.write_text(f"[127.0.0.1]:{proxy.port} {key}")
    config = load_pipeline(
        tmp_path,
        ssh_compute(tmp_path, sshd, layout, port=proxy.port, known_hosts=known_hosts, heartbeat_timeout_s=5),
        runtime_checks=True,
    )
    spec, ship = stage(layout, make_samples(10), training=False)
    fifo = block_on_fifo(layout)

    def fault_then_release() -> None:
        wait_until(
            lambda: "shards_done=2" in run_dir_messages(layout), 90, "the remote worker blocked in its third shard"
        )
        if fault == "cut":
            proxy.cut()
        else:
            proxy.freeze()
            time.sleep(5 + 3)  # past the heartbeat timeout: the orchestrator gave the link up
            proxy.thaw()
        with fifo.open("wb") as handle:  # the worker, still running, reads its last sample
            handle.write(sample_bytes(7))

    helper = threading.Thread(target=fault_then_release, daemon=True)
    helper.start()
    instance = dg.DagsterInstance.ephemeral()
    try:
        result = dg.materialize(
            [heavy_asset(config.source_file, "import-specforge", spec, ship, INDEX_AND_MANIFEST)], instance=instance
        )
    finally:
        proxy.close()
    helper.join(timeout=5)
    lines = messages(instance, result.run_id)
    dropped = [m for m in lines if m.startswith("connection to 127.0.0.1")]
    print(f"\n-- run log after the {fault}:", *dropped, sep="\n   ")
    assert result.success and dropped
    assert (
        "reconnected: it is still running (pid" in dropped[0] or "reconnected: it is exited with status 0" in dropped[0]
    )
    [materialization] = result.asset_materializations_for_node("hidden_states")
    assert materialization.metadata["samples"].value == 11
    assert any(m.startswith("progress: shards_done=3") for m in lines)


def config_only_target(folder: Path) -> Path:
    """A target folder with only its config.json (the shape of specforge_files.TARGET): the
    import's identity is read from it; no weights are needed or loaded."""
    folder.mkdir(parents=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": TARGET["hidden_size"],
        "num_hidden_layers": TARGET["num_layers"],
        "vocab_size": TARGET["vocab_size"],
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 16,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_command_kind_runs_the_users_extractor_then_imports_its_output(
    tmp_path: Path, sshd: Sshd, idle_gpus: Any, layout: Layout
) -> None:
    samples = make_samples(10, seed=5)
    prepared = write_specforge(tmp_path / "prepared", samples[:6])
    write_specforge(tmp_path / "prepared", samples[6:], compress=True)
    write_training_data(layout.local / "training_data", samples)
    (layout.local / "training_data" / "manifest.json").write_text(
        json.dumps(
            {
                "shards": {"train": ["train-00000.parquet"], "eval": ["eval-00000.parquet"]},
                "vocab_size": TARGET["vocab_size"],
                "version": "td-test",
            }
        )
    )
    target = config_only_target(tmp_path / "target")
    command = (
        "echo prepare_hidden_states.py --output-path {output_dir} "
        f"&& cp -R {prepared}/. {{output_dir}}/ "
        "&& echo wrote $(ls {output_dir}/rows_0-2000 | wc -l) files"
    )
    config = load_pipeline(
        tmp_path, ssh_compute(tmp_path, sshd, layout, kind="command", command=command), runtime_checks=True
    )
    spec = {  # what extract.spec_from_config gives: the phase's settings and where things are
        "training_data": str(layout.local / "training_data"),
        "output": str(layout.local / "hidden_states"),
        "model": str(target),
        "target_name": TARGET["name"],
        "aux_layer_ids": LAYERS,
    }
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize(
        [heavy_asset(config.source_file, "extract", spec, [str(layout.local / "training_data")], INDEX_AND_MANIFEST)],
        instance=instance,
    )
    assert result.success
    lines = messages(instance, result.run_id)
    command_lines = [m for m in lines if m.startswith("[command]")]
    print("\n-- the user command's output in the run log:", *command_lines, sep="\n   ")
    assert command_lines[-1] == "[command] wrote 10 files"
    assert any(m.startswith("importing 10 SpecForge samples") for m in lines)
    [materialization] = result.asset_materializations_for_node("hidden_states")
    output = layout.remote / "specforge" / "td-test"  # named by the training data's version
    assert materialization.metadata["command_output"].value == str(output)
    assert any(m.startswith(f"imported, so deleted the command's output {output}") for m in lines)
    assert not output.exists() and list((layout.remote / "specforge").iterdir()) == []
    assert materialization.metadata["loss_mask_disagreements"].value == 0
    manifest = json.loads((layout.local / "hidden_states" / "manifest.json").read_text())
    assert manifest["training_data_version"] == "td-test" and manifest["aux_layer_ids"] == LAYERS
    assert manifest["target"] == {
        **TARGET,
        "config_sha256": hashlib.sha256((target / "config.json").read_bytes()).hexdigest(),
    }

    ours = tmp_path / "ours"
    writer = ShardWriter(ours, 0)
    for s in samples:
        writer.add(
            s.sample_id,
            s.dataset,
            split=s.split,
            input_ids=s.input_ids,
            loss_mask=s.loss_mask,
            aux=s.aux,
            hidden=s.hidden,
        )
    writer.close()
    assert shard_contents(layout.remote / "hidden_states") == shard_contents(ours)
    assert sorted(p.name for p in (layout.local / "hidden_states").iterdir()) == ["index.parquet", "manifest.json"]


def test_command_kind_replaces_only_extraction(tmp_path: Path, sshd: Sshd, idle_gpus: Any, layout: Layout) -> None:
    """Any other phase on a `compute: command` host runs our worker there, as with `ssh`; the
    command (which would fail the step) never runs."""
    config = load_pipeline(
        tmp_path,
        ssh_compute(tmp_path, sshd, layout, kind="command", command="echo the user command ran; exit 3"),
        runtime_checks=True,
    )
    spec, ship = stage(layout, make_samples(4))
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize(
        [heavy_asset(config.source_file, "import-specforge", spec, ship, INDEX_AND_MANIFEST)], instance=instance
    )
    assert result.success
    assert not any(m.startswith("[command]") for m in messages(instance, result.run_id))
    [materialization] = result.asset_materializations_for_node("hidden_states")
    assert materialization.metadata["compute"].value == "command" and "command_output" not in materialization.metadata
    assert materialization.metadata["samples"].value == 4
