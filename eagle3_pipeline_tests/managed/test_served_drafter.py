"""The benchmark's arms and the served drafter on the managed server's own launch lines, with the SGLang stand-in
of conftest as the engine (no SGLang engine, no GPU here): its `/generate` reports `spec_verify_ct` as SGLang's
meta_info does (2 tokens per verify step; none for a request answered without a verify step), and it exits at
start-up when the drafter folder has no config.json, as SGLang does when it cannot load the drafter. The
real-vLLM run of the same is real_vllm/test_main_job.py."""

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.drafter.serve.benchmark import benchmark_settings, eval_prompts, make_gate, run_benchmark
from eagle3_pipeline.drafter.serve.client import BenchmarkError
from eagle3_pipeline.drafter.serve.record import drafter_digest, record_result
from eagle3_pipeline.drafter.serve.served_drafter import (
    ServedDrafter,
    ServedDrafterError,
    ServedRecord,
    decide,
    serve_drafter,
)
from eagle3_pipeline.drafter.serve.servers import ManagedServers
from eagle3_pipeline.health.gate import thresholds_for
from eagle3_pipeline.hosts import LocalHost
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed import ServerEvent, ServerPurpose, open_supervisor
from eagle3_pipeline.testing.process_tools import write_atomic
from eagle3_pipeline_tests.managed.pipelines import fake_sglang_serving
from eagle3_pipeline_tests.pipeline_files import load_pipeline

STEPS = 3
GENERATION = ServerPurpose.generation(needs_tools=False)


pytestmark = pytest.mark.usefixtures("stop_servers")


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """These tests start `python -m sglang.launch_server` stand-ins, which the health tests look for."""


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, message: str) -> None:
        self.lines.append(message)

    def progress(self, metrics: Mapping[str, Any]) -> None:
        return None


def pipeline(tmp_path: Path, **benchmark: Any) -> PipelineConfig:
    """A managed SGLang stand-in (a reasoning parser, so generation's line is not the benchmark's), four eval
    rows in training_data, and the drafter benchmark at K = 3."""
    serving = fake_sglang_serving(tmp_path, reasoning_parser="kimi_k2", served_drafter_prompts=3)
    sections = {
        "serving": serving,
        "health": {"expected_gpus": 0},
        "drafter_benchmark": {
            "server": "sglang",
            "steps": STEPS,
            "prompts": 4,
            "max_tokens": 16,
            "concurrencies": [2],
            "sweep_steps": [],
            "max_server_starts": 2,
            **benchmark,
        },
    }
    config = load_pipeline(tmp_path, sections)
    folder = ArtifactLayout(config.artifacts_root).training_data
    folder.mkdir(parents=True, exist_ok=True)
    rows = {"input_ids": [[1, 2, 3, 4, 5, 6]] * 4, "loss_mask": [[0, 0, 0, 1, 1, 1]] * 4}
    pq.write_table(pa.table(rows), folder / "eval-00000.parquet")
    return config


def export(config: PipelineConfig, content: str, loadable: bool = True) -> Path:
    """The trained drafter's export folder (a file standing in for its weights; config.json unless not loadable)."""
    folder = config.artifacts_root / "drafter" / "export"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_text(content)
    if loadable:
        (folder / "config.json").write_text("{}")
    return folder


def test_the_benchmarks_arms_are_the_managed_servers_launch_lines(tmp_path: Path) -> None:
    config = pipeline(tmp_path)
    drafter = export(config, "v1")
    settings, setup = benchmark_settings(config)
    assert setup is not None and settings.draft_model_path == str(drafter)
    assert settings.target_model_path == "/models/target" and settings.base_url == f"http://127.0.0.1:{setup.port}"
    prompts = eval_prompts(ArtifactLayout(config.artifacts_root).training_data, settings.prompts)
    host = LocalHost()
    gate = make_gate(host, thresholds_for(config.health, config.artifacts_root))
    # each server's first /generate answers one token at once: SGLang reports no spec_verify_ct for it
    write_atomic(tmp_path / "engine" / "scenario.json", json.dumps({"no_verify_requests": 1}))
    events: list[ServerEvent] = []
    log = Log()
    with open_supervisor(config, on_event=events.append) as supervisor:
        assert supervisor is not None
        supervisor.ensure(GENERATION, "responses B1")
        generation = supervisor.server.status().record
        with supervisor.arms("drafter_benchmark", after=lambda: None):
            arms = ManagedServers(supervisor, str(drafter))
            result = run_benchmark(
                settings, host, base_url=str(settings.base_url), prompts=prompts, gate=gate, report=log, servers=arms
            )
    # the baseline arm differs from the generation server only by --reasoning-parser: kept, not reloaded
    assert [(e.action, e.role) for e in events] == [
        ("started", "generation"),
        ("kept", "generation"),
        ("stopped", "generation"),
        ("started", "benchmark-speculative"),
        ("stopped", "benchmark-speculative"),
    ]
    assert generation is not None and "--reasoning-parser" in generation.argv
    assert events[1].reason.startswith("drafter_benchmark: the baseline arm: running since ")
    assert (
        events[2].reason
        == "drafter_benchmark: the speculative-K3-top1-4 arm: it runs as generation, benchmark-speculative is needed"
    )
    assert "--speculative-draft-model-path" in events[3].metadata["command"]
    # 3 requests of 16 tokens in 8 verify steps each; the fourth, with none, counted apart
    [speculative] = result.arms
    assert result.baseline.tau is None and speculative.tau == pytest.approx(2.0)
    assert speculative.acceptance is not None and speculative.acceptance.no_verify_requests == 1
    assert speculative.at(2).completion_tokens == 3 * 16 + 1
    assert result.as_metadata()["no_verify_requests"] == 1
    assert "speculative-K3-top1-4: 1 of 4 request(s) had no verify step" in "\n".join(log.lines)
    assert result.baseline.server_process.startswith(f"sglang server pid {generation.pid}")


def test_a_managed_benchmark_refuses_the_settings_of_another_server(tmp_path: Path) -> None:
    config = pipeline(tmp_path, launch_command="python -m sglang.launch_server --port {port}", server="vllm")
    with pytest.raises(BenchmarkError, match=r"launch_command is set; server is vllm, the managed server's engine"):
        benchmark_settings(config)


def candidate(digest: str, tau_eval: float | None, tau_benchmark: float | None = None) -> ServedDrafter:
    return ServedDrafter(f"/d/{digest}", digest, STEPS, tau_eval, tau_benchmark)


def test_a_drafter_is_served_only_when_its_tau_beats_the_served_ones() -> None:
    served = ServedRecord(candidate("a", 2.0, 2.4))
    assert decide(candidate("a", 1.0), None) == (True, "no drafter is served yet")
    assert decide(candidate("a", 9.0), served)[0] is False  # the same drafter
    assert decide(candidate("b", 2.1), served) == (
        True,
        "the new drafter's drafter_eval τ 2.1000 beats the served one's (2.0000)",
    )
    # the benchmark's τ from the server's counters decides when both have one
    assert decide(candidate("b", 2.1, 2.3), served) == (
        False,
        "the new drafter's drafter_benchmark τ from the server's counters 2.3000 does not beat the served one's 2.4000",
    )
    assert decide(candidate("b", None), served)[0] is False


def test_serve_keep_and_roll_back(tmp_path: Path) -> None:
    """The first drafter is served (none was), the same one is kept, a weaker one leaves it served, and one that
    does not start is rolled back from, to the launch line recorded for the served one."""
    config = pipeline(tmp_path)
    layout = ArtifactLayout(config.artifacts_root)
    events: list[ServerEvent] = []
    with open_supervisor(config, on_event=events.append) as supervisor:
        assert supervisor is not None
        export(config, "v1")
        first = serve_drafter(config, supervisor, {f"tau@{STEPS}/all": 1.5}, Log())
        assert first.decision == "served the new drafter: no drafter is served yet"
        assert first.as_metadata()["tau_served"] == pytest.approx(2.0) and first.measured.requests == 3
        served = first.served
        assert served is not None
        assert Path(served.drafter).parent == config.artifacts_root / "drafter" / "served"
        assert (Path(served.drafter) / "config.json").is_file() and "--speculative-draft-model-path" in served.argv

        again = serve_drafter(config, supervisor, {f"tau@{STEPS}/all": 1.5}, Log())
        assert again.decision.startswith("kept the served drafter: the same drafter")

        export(config, "v2")
        weaker = serve_drafter(config, supervisor, {f"tau@{STEPS}/all": 1.2}, Log())
        assert weaker.decision.endswith("1.2000 does not beat the served one's 1.5000")
        assert weaker.served is not None and weaker.served.drafter == served.drafter

        export(config, "v3", loadable=False)
        with pytest.raises(ServedDrafterError, match=r"(?s)rolled back to the drafter served before .*cannot load"):
            serve_drafter(config, supervisor, {f"tau@{STEPS}/all": 3.0}, Log())
        status = supervisor.server.status()
        assert status.state == "running" and status.record is not None
        assert status.record.argv == served.argv  # the recorded launch line, restored
        record = ServedRecord.read(layout.served_drafter)
        assert record is not None and record.current is not None and record.current.digest == served.digest
        assert record.previous is None
        supervisor.release("test done")
    assert [(e.action, e.role) for e in events] == [
        ("started", "served-drafter"),
        ("kept", "served-drafter"),
        ("kept", "served-drafter"),
        ("stopped", "served-drafter"),
        ("failed", "served-drafter"),  # the new drafter's server exited during start-up (what it left is stopped)
        ("started", "served-drafter"),
        ("stopped", "served-drafter"),
    ]
    assert "cannot load the draft model" in events[4].reason
    assert events[5].reason == "served_drafter: roll back to the drafter served before"


def benchmarked(config: PipelineConfig, chosen: dict[str, int] | None, reason: str) -> None:
    """drafter_benchmark's record for the exported drafter, with its choice at the serving concurrency."""
    digest = drafter_digest(LocalHost(), str(config.artifacts_root / "drafter" / "export"))
    arms = [{"arm": "speculative-K5-top1-6", "config": {"steps": 5, "topk": 1, "draft_tokens": 6}, "tau": 2.7}]
    result = {"choice": {"config": chosen, "reason": reason}, "arms": arms}
    record_result(ArtifactLayout(config.artifacts_root).drafter_benchmark, {"drafter": digest}, result)


def test_the_benchmarks_winner_is_served_or_the_target_alone(tmp_path: Path) -> None:
    """Where the benchmark found no configuration faster than the target alone, the target is served without a
    drafter, said so with the figures in the metadata and the record; a drafter whose benchmark chose K5 is then
    served in that configuration."""
    config = pipeline(tmp_path)
    layout = ArtifactLayout(config.artifacts_root)
    events: list[ServerEvent] = []
    slower = "no configuration beats the target alone at concurrency 2: the fastest, K3·top1·4, makes 40.0 tok/s"
    with open_supervisor(config, on_event=events.append) as supervisor:
        assert supervisor is not None
        export(config, "v1")
        benchmarked(config, None, slower)
        alone = serve_drafter(config, supervisor, {f"tau@{STEPS}/all": 1.5}, Log())
        assert alone.served is None and alone.decision == f"the target is served without a drafter: {slower}"
        metadata = alone.as_metadata()
        assert metadata["served_drafter"] == "none: the target alone" and metadata["tau_served"] is None
        assert metadata["served_tokens_per_s"] > 0 and metadata["tau_served_prompts"] == 3
        record = ServedRecord.read(layout.served_drafter)
        assert record == ServedRecord(None, None, slower)

        export(config, "v2")
        benchmarked(config, {"steps": 5, "topk": 1, "draft_tokens": 6}, "K5·top1·6 is fastest at concurrency 2")
        faster = serve_drafter(config, supervisor, {"tau@5/all": 2.2}, Log())
        assert faster.decision.startswith("served the new drafter: the target is served alone")
        assert faster.served is not None and (faster.served.steps, faster.served.tau_benchmark) == (5, 2.7)
        argv = " ".join(faster.served.argv)
        assert "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6" in argv
        record = ServedRecord.read(layout.served_drafter)
        assert record is not None and record.current is not None and record.current.steps == 5
        supervisor.release("test done")
    assert [(e.action, e.role) for e in events][:3] == [
        ("started", "generation"),
        ("stopped", "generation"),
        ("started", "served-drafter"),
    ]
