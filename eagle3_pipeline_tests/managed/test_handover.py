"""GPU hand-overs as the phases ask for them, and as Dagster records them: which managed server shares a phase's
machine, when generation work remains (from the artifacts), a phase's own server for a block, and each start and
stop on the run and as an observation of `inference_server` (a real Dagster instance; the engine is the SGLang
stand-in of conftest: no GPU, no SGLang engine on this machine)."""

import json
import os
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_pipeline.components.health.inference_server import server_event_observation
from eagle3_pipeline.components.managed import hand_over, supervised
from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import HostConfig
from eagle3_pipeline.config.phases import GPU_PHASES
from eagle3_pipeline.generation.fingerprint import configured_fingerprint
from eagle3_pipeline.hidden_states.vllm_server import (
    ExtractionServerError,
    extraction_purpose,
    managed_extraction_server,
)
from eagle3_pipeline.hosts import LocalHost
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed import ServerEvent, ServerPurpose, managed_server, open_supervisor
from eagle3_pipeline.managed.phases import after_gpu_phase, gpu_phase_server, incomplete_partitions, same_machine
from eagle3_pipeline.orchestration.hosts import NoHostFree, hold_host
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES
from eagle3_pipeline.orchestration.partition_runs import GENERATION_JOB, HOST_TAG, POOL_TAG, hosts_in_flight
from eagle3_pipeline_tests.managed.pipelines import fake_sglang_serving
from eagle3_pipeline_tests.pipeline_files import load_pipeline

GENERATION = ServerPurpose.generation(needs_tools=False)
SSH: dict[str, Any] = {"kind": "ssh", "hostname": "gpu-box.internal", "username": "eagle3"}


pytestmark = pytest.mark.usefixtures("stop_servers")


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """These tests start `python -m sglang.launch_server` stand-ins, which the health tests look for."""


def test_a_phase_hands_over_the_managed_server_of_its_own_machine(tmp_path: Path) -> None:
    box = HostConfig.model_validate(SSH)
    assert same_machine(HostConfig(), HostConfig())
    assert same_machine(box, HostConfig.model_validate({**SSH, "hostname": "GPU-BOX.internal", "username": "x"}))
    assert not same_machine(box, HostConfig.model_validate({**SSH, "port": 2222}))
    assert not same_machine(HostConfig(), box)

    serving = {"managed": True, "model": "/models/t", "port": 30000}
    on_box = load_pipeline(tmp_path, {"serving": serving, "health": {"host": SSH}})
    # compute local: training runs here, not on the server's box; the benchmark runs on the box
    assert gpu_phase_server(on_box, "eagle3_drafter") is None
    assert gpu_phase_server(on_box, "drafter_benchmark") == managed_server(on_box)
    remote = {"kind": "ssh", "host": SSH, "workdir": "/w", "artifacts_root": "/a"}
    both = load_pipeline(tmp_path, {"serving": serving, "health": {"host": SSH}, "compute": remote})
    for phase in GPU_PHASES:
        assert gpu_phase_server(both, phase) == managed_server(both), phase
    assert gpu_phase_server(load_pipeline(tmp_path, {}), "eagle3_drafter") is None  # nothing managed


def _touch(path: Path, at: float, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (at, at))


def test_generation_work_remains_until_every_partition_is_complete(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, {"serving": fake_sglang_serving(tmp_path)})
    layout = ArtifactLayout(config.artifacts_root)
    assert incomplete_partitions(config) == ["B1"] and after_gpu_phase(config) == GENERATION
    now = time.time()
    fingerprint = configured_fingerprint(config.generation, config.target, config.inference)
    _touch(layout.prompts("B1"), now - 30)
    _touch(layout.fingerprint("B1"), now - 30, json.dumps({"fingerprint": fingerprint.fields()}))
    _touch(layout.checkpoint("B1"), now - 20)
    _touch(layout.responses("B1"), now - 10)
    assert incomplete_partitions(config) == [] and after_gpu_phase(config) is None
    _touch(layout.checkpoint("B1"), now)  # an answer appended after the table: a run that did not finish
    assert incomplete_partitions(config) == ["B1"]
    _touch(layout.responses("B1"), now + 1)
    _touch(layout.fingerprint("B1"), now - 30, json.dumps({"fingerprint": {**fingerprint.fields(), "max_tokens": 1}}))
    assert incomplete_partitions(config) == ["B1"]  # answers under other settings are regenerated


def test_a_phases_own_server_for_a_block_then_generation_or_nothing(tmp_path: Path) -> None:
    # a reasoning parser: the generation line differs from the benchmark's (which has no parser) by it alone,
    # so the generation server serves the baseline arm as it is (token-id requests use no parser)
    config = load_pipeline(tmp_path, {"serving": fake_sglang_serving(tmp_path, reasoning_parser="kimi_k2")})
    events: list[ServerEvent] = []
    benchmark = ServerPurpose.benchmark(None)
    with open_supervisor(config, on_event=events.append) as supervisor:
        assert supervisor is not None
        supervisor.ensure(GENERATION, "responses B1")
        with supervisor.serving(benchmark, "drafter_benchmark", after=lambda: GENERATION) as launch:
            assert launch.purpose.role == "benchmark-baseline" and "--reasoning-parser" in launch.argv
        record = supervisor.server.status().record
        assert record is not None and record.role == "generation"
        with supervisor.serving(benchmark, "drafter_benchmark", after=lambda: None):
            pass
        assert supervisor.server.status().state == "absent"
    assert [(e.action, e.role) for e in events] == [
        ("started", "generation"),
        ("kept", "generation"),
        ("kept", "generation"),
        ("kept", "generation"),
        ("stopped", "generation"),
    ]
    assert events[-1].reason == "after drafter_benchmark: no work waits for the server"


def test_dagster_records_every_start_and_stop_as_an_observation(tmp_path: Path) -> None:
    """A run that starts the generation server for a partition, then hands the GPUs to training: the run's
    log has each line, and `inference_server` an observation per start and stop with its reason, duration
    and who holds the GPUs after."""
    config = load_pipeline(tmp_path, {"serving": fake_sglang_serving(tmp_path)})

    @dg.asset
    def training(context: dg.AssetExecutionContext) -> None:
        with supervised(context, config, DEFAULT_NAMES) as supervisor:  # as responses makes it serve
            assert supervisor is not None
            supervisor.ensure(GENERATION, "responses B1")
        with hand_over(context, config, DEFAULT_NAMES, "eagle3_drafter") as supervisor:
            assert supervisor is not None and supervisor.server.status().state == "absent"

    with dg.DagsterInstance.ephemeral() as instance:
        assert dg.materialize([training], instance=instance).success
        records = instance.fetch_observations(dg.AssetKey("inference_server"), limit=1000, ascending=True).records
        observations = [r.asset_observation for r in records if r.asset_observation is not None]
        seen: list[dict[str, Any]] = [{k: v.value for k, v in o.metadata.items()} for o in observations]
        logs = [entry.user_message for entry in instance.all_logs(records[0].run_id)]
    assert [(m["event"], m["role"], m["gpus_held_by"]) for m in seen] == [
        ("started", "generation", "generation"),
        ("stopped", "generation", "none"),
        ("started", "generation", "generation"),  # B1's responses are not complete
    ]
    assert [m["reason"] for m in seen] == [
        "responses B1",
        "eagle3_drafter needs the GPUs",
        "after eagle3_drafter: generation work remains",
    ]
    assert all(m["duration_s"] > 0 for m in seen) and seen[1]["verified"] and seen[1]["signals"] == ["TERM"]
    assert any(line.startswith("managed server serving (generation) stopped in") for line in logs)
    with open_supervisor(config) as supervisor:
        assert supervisor is not None and supervisor.release("test done") is not None


def test_an_observation_of_a_host_of_several() -> None:
    event = ServerEvent("kept", "box1", "served-drafter", "responses B2", metadata={"pid": 7, "port": 30000})
    observation = server_event_observation(event, "box1")
    assert observation.asset_key == dg.AssetKey(["inference_server", "box1"])
    metadata: dict[str, Any] = {k: v.value for k, v in observation.metadata.items()}
    assert metadata["inference_host"] == "box1" and metadata["gpus_held_by"] == "served-drafter"
    assert metadata["summary"] == "managed server box1 (served-drafter) kept: responses B2"


def test_a_managed_vllm_server_is_the_extraction_server_with_the_stores_ids(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 30,
                "hidden_size": 576,
                "vocab_size": 49152,
                "num_attention_heads": 9,
                "intermediate_size": 1536,
            }
        )
    )
    serving = {"managed": True, "engine": "vllm", "model": str(model), "port": 8123}
    config = load_pipeline(tmp_path, {"serving": serving, "hidden_states": {"backend": "vllm"}})
    setup = managed_extraction_server(config)
    assert setup is not None and config.hidden_states.vllm_base_url == "http://127.0.0.1:8123/v1"
    folder = Path(str(config.hidden_states.vllm_output_dir))
    assert folder == config.artifacts_root / "vllm_connector" and not folder.exists()
    purpose = extraction_purpose(config.hidden_states, config.source_file, setup, LocalHost())
    assert purpose.extraction is not None and purpose.extraction.layer_ids == (2, 15, 27, 30)  # [1, 14, 26] + 1, N
    assert folder.is_dir()
    (model / "config.json").unlink()
    with pytest.raises(ExtractionServerError, match=r"serving\.model: .*config\.json on localhost: not readable"):
        extraction_purpose(config.hidden_states, config.source_file, setup, LocalHost())
    # a URL of the user's own extraction server: not the managed one's
    own = load_pipeline(
        tmp_path,
        {
            "serving": serving,
            "hidden_states": {"backend": "vllm", "vllm_base_url": "http://127.0.0.1:9/v1", "vllm_output_dir": "/s"},
        },
    )
    assert managed_extraction_server(own) is None


def test_a_gpu_phase_holds_its_inference_host_once_no_run_does(tmp_path: Path) -> None:
    """With several inference hosts, a GPU phase takes its host's pool as a generation run does (the run tags
    eagle3/host and eagle3/pool): it waits while another run holds the host, then holds it, so that no
    generation run is placed there meanwhile; past launch.host_wait_s it gives up, naming the holder."""
    hosts = [{"name": n, "endpoints": [{"base_url": f"http://127.0.0.1:{p}/v1"}]} for n, p in (("a", 9), ("b", 8))]
    config = load_pipeline(
        tmp_path, {"inference": {"kind": "endpoints", "hosts": hosts}, "launch": {"host_poll_s": 0.01}}
    )
    defs = build_definitions(config)
    generation, downstream = (defs.resolve_job_def(name) for name in (GENERATION_JOB, "downstream_job"))
    started = dg.DagsterRunStatus.STARTED
    with dg.instance_for_test() as instance:
        holder = instance.create_run_for_job(
            generation, tags={HOST_TAG: "a", POOL_TAG: "gpu-a", "dagster/partition": "B1"}, status=started
        )
        phase = instance.create_run_for_job(downstream, status=started)
        said: list[str] = []

        def polled(seconds: float) -> None:
            instance.report_run_failed(holder)

        hold_host(
            instance,
            phase.run_id,
            launch=config.launch,
            inference=config.inference,
            host_name="a",
            log=said.append,
            sleep=polled,
        )
        assert said == [
            f"waiting: inference host a (pool gpu-a) is held by run(s) {holder.run_id[:8]}",
            "holding inference host a (pool gpu-a) for this run",
        ]
        run = instance.get_run_by_id(phase.run_id)
        assert run is not None and (run.tags[HOST_TAG], run.tags[POOL_TAG]) == ("a", "gpu-a")
        assert hosts_in_flight(instance, DEFAULT_NAMES).hosts == {"a": [phase.run_id]}

        other = instance.create_run_for_job(downstream, status=started)
        impatient = config.model_copy(update={"launch": config.launch.model_copy(update={"host_wait_s": 0})})
        with pytest.raises(
            NoHostFree, match=rf"held by run\(s\) {phase.run_id[:8]} for longer than launch.host_wait_s"
        ):
            hold_host(
                instance,
                other.run_id,
                launch=impatient.launch,
                inference=impatient.inference,
                host_name="a",
                log=said.append,
            )
