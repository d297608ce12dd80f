"""The table of the GPU phases (eagle3_pipeline.config.phases) and its readers: each reader covers every row, so a
phase added to the table, or left out of a reader, fails here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest

from eagle3_pipeline.cli.schedule import server_before, serving_schedule
from eagle3_pipeline.components.managed import hand_over
from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import ComputeConfig, ConfigError, HealthConfig, HostConfig
from eagle3_pipeline.config.phases import GPU_PHASES, HEAVY_PHASES, PHASES, Handover, phase_row
from eagle3_pipeline.generation.planning import build_plan
from eagle3_pipeline.managed.phases import phase_host
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES
from eagle3_pipeline.orchestration.step_tags import K8S_CONFIG_TAG, step_tags
from eagle3_pipeline_tests.pipeline_files import load_pipeline

# A managed vLLM that is also the extraction server, the benchmark and the served drafter: every row in play.
EVERY_PHASE = {
    "serving": {"managed": True, "engine": "vllm", "model": "/models/t", "port": 8123, "serve_drafter": True},
    "hidden_states": {"backend": "vllm"},
    "drafter_benchmark": {"server": "vllm", "steps": 3},
}


def test_the_table_lists_each_phase_once_in_the_main_jobs_order() -> None:
    assert GPU_PHASES == (
        "responses",
        "hidden_states",
        "eagle3_drafter",
        "drafter_eval",
        "drafter_benchmark",
        "served_drafter",
    )
    assert HEAVY_PHASES == ("hidden_states", "eagle3_drafter", "drafter_eval")
    assert all(phase_row(row.phase) is row for row in PHASES)
    with pytest.raises(KeyError):
        phase_row("training_data")


def test_the_gpu_pool_holds_the_steps_of_the_tables_phases_and_no_other(tmp_path: Path) -> None:
    graph = build_definitions(load_pipeline(tmp_path, EVERY_PHASE)).resolve_asset_graph()
    pooled = {key.to_user_string() for key in graph.get_all_asset_keys() if graph.get(key).pools == {"gpu"}}
    assert pooled == set(GPU_PHASES)


def test_the_executors_step_tags_go_to_the_heavy_rows_here_and_to_embedded_generation(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, {"inference": {"kind": "embedded"}, "deploy": {"executor": "k8s"}})
    tagged = [p for p in GPU_PHASES if K8S_CONFIG_TAG in step_tags(config.deploy, config.inference, config.compute, p)]
    assert tagged == ["responses", *HEAVY_PHASES]


def test_phase_pools_takes_every_gpu_phase_and_refuses_another_name(tmp_path: Path) -> None:
    pools = {phase: "gpu" for phase in GPU_PHASES}
    assert load_pipeline(tmp_path, {"deploy": {"phase_pools": pools}}).deploy.phase_pools == pools
    with pytest.raises(ConfigError, match=r"deploy\.phase_pools\.training_data.*'responses'.*'served_drafter'"):
        load_pipeline(tmp_path, {"deploy": {"phase_pools": {"training_data": "gpu"}}})


def test_a_phase_uses_the_gpus_of_its_rows_machine() -> None:
    box = HostConfig.model_validate({"kind": "ssh", "hostname": "gpu-box", "username": "u"})
    server = HostConfig.model_validate({"kind": "ssh", "hostname": "server-box", "username": "u"})
    compute = ComputeConfig.model_validate(
        {"kind": "ssh", "host": box.model_dump(), "workdir": "/w", "artifacts_root": "/a"}
    )
    health = HealthConfig.model_validate({"host": server.model_dump()})
    machines = {row.phase: phase_host(compute, health, row.phase) for row in PHASES}
    assert machines == {row.phase: server if row.machine == "server" else box for row in PHASES}


def test_the_schedule_walks_the_tables_rows_in_order(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, EVERY_PHASE)
    steps = serving_schedule(config, build_plan(config, {"managed": None}, {}), {}).steps
    assert [step.phase for step in steps if step.gpu] == [f"responses ×{len(config.dataset_ids)}", *GPU_PHASES[1:]]


def test_each_hand_over_has_its_own_words_in_plan() -> None:
    """`plan`'s "server before it" from the row's hand-over and what the server serves so far."""
    words: dict[Handover, tuple[str, str | None]] = {
        "serves": ("start generation", "generation server"),
        "stops": ("stop generation (verified)", None),
        "purpose": ("stop generation, start extraction (the store's layer ids)", "extraction server"),
        "arms": ("stop generation, start baseline, then with the drafter (K=3); stop", "benchmark servers"),
        "keeps": (
            "start served-drafter if its τ beats the served one's (else the served one again)",
            "served-drafter server",
        ),
    }
    assert set(words) == set(get_args(Handover))
    state: dict[Handover, Any] = {h: None if h == "serves" else "generation" for h in words}
    assert {h: server_before(h, state[h], True, True, 3) for h in words} == words
    # no extraction server: `purpose` stops the server as `stops` does; no managed server on the phase's machine
    assert server_before("purpose", "generation", True) == words["stops"]
    assert server_before("stops", None, True) == ("— (stopped)", None)
    assert server_before("arms", "generation", False) == ("— (no managed server on its machine)", None)
    assert server_before("serves", None, False) == ("—", None)


def test_the_run_hands_nothing_over_for_the_phase_the_server_serves(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, EVERY_PHASE)
    with pytest.raises(ValueError, match="responses: the server serves it"):
        with hand_over(None, config, DEFAULT_NAMES, "responses"):
            pass
