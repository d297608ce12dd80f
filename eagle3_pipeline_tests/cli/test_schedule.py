"""`eagle3-pipeline plan`'s schedule: the managed server's transitions before each phase in the main job's order,
who holds the GPUs, and each phase's GPU time with its basis — UNKNOWN where nothing recorded gives one."""

import json
from pathlib import Path
from typing import Any

from eagle3_pipeline.cli.schedule import UNKNOWN, serving_schedule
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation.planning import Throughput, build_plan
from eagle3_pipeline.generation.prompts import write_prompts
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline_tests.pipeline_files import load_pipeline

SERVING = {"managed": True, "engine": "vllm", "model": "/models/t", "port": 8123}
BENCHMARK = {"server": "vllm", "steps": 3}


def schedule_of(config: PipelineConfig, throughput: dict[str, Throughput | None]) -> dict[str, Any]:
    plan = build_plan(config, throughput, {})
    return {step.phase: step for step in serving_schedule(config, plan, {}).steps}


def test_the_schedule_follows_the_server_from_generation_to_the_served_drafter(tmp_path: Path) -> None:
    sections = {"serving": SERVING, "hidden_states": {"backend": "vllm"}, "drafter_benchmark": BENCHMARK}
    config = load_pipeline(tmp_path, sections)
    steps = schedule_of(config, {"managed": None})
    assert list(steps) == [
        "responses ×1",
        "training_data",
        "draft_vocab",
        "hidden_states",
        "eagle3_drafter",
        "drafter_eval",
        "drafter_benchmark",
        "served_drafter",
    ]
    assert [steps[p].server for p in ("responses ×1", "hidden_states", "eagle3_drafter", "drafter_benchmark")] == [
        "start generation",
        "stop generation, start extraction (the store's layer ids)",
        "— (stopped)",
        "start baseline, then with the drafter (K=3); stop",
    ]
    assert steps["training_data"].gpu_time == "none" and steps["eagle3_drafter"].gpu_time == UNKNOWN
    assert steps["responses ×1"].gpu_time == UNKNOWN and "prompts not materialized" in steps["hidden_states"].basis
    assert steps["drafter_benchmark"].basis == "no benchmark recorded here (drafter_benchmark.json)"


def test_gpu_time_from_what_earlier_runs_recorded(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, {"serving": SERVING, "drafter_benchmark": BENCHMARK})
    layout = ArtifactLayout(config.artifacts_root)
    write_prompts(config.datasets[0], config.prompts, config.seed, layout.prompts("B1"))
    layout.training_data.mkdir(parents=True)
    (layout.training_data / "manifest.json").write_text(json.dumps({"tokens": 10000}))
    layout.hidden_states.mkdir(parents=True)
    (layout.hidden_states / "result.json").write_text(json.dumps({"metadata": {"tokens_per_s": 500.0}}))
    arms = [{"levels": [{"wall_s": 1.0}, {"wall_s": 2.0}]}, {"levels": [{"wall_s": 2.0}]}]  # each concurrency
    layout.drafter_benchmark.write_text(json.dumps({"identity": {}, "result": {"arms": arms}}))
    steps = schedule_of(config, {"managed": Throughput(100.0, 10, 5.0, "calibration")})
    generation = steps["responses ×1"]
    # one pending prompt, max_tokens (an upper bound without answers) at 100 tokens/s
    assert generation.gpu_time_s == config.generation.max_tokens / 100.0 and "the planner" in generation.basis
    assert steps["hidden_states"].gpu_time_s == 20.0 and "10,000 tokens / 500 tokens/s" in steps["hidden_states"].basis
    assert steps["hidden_states"].server == "stop generation (verified)"  # backend transformers, on this machine
    assert steps["drafter_benchmark"].gpu_time_s == 5.0


def test_an_unmanaged_server_has_no_transitions(tmp_path: Path) -> None:
    config = load_pipeline(tmp_path, {})
    plan = build_plan(config, {}, {})
    schedule = serving_schedule(config, plan, {})
    assert "the inference server is the user's" in schedule.heading
    assert {step.server for step in schedule.steps} <= {"—", "— (no managed server on its machine)"}
    assert "served_drafter" not in [step.phase for step in schedule.steps]
