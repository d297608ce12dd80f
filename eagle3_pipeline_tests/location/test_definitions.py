"""The code location loads fast (no torch/transformers), validates, and has the agreed shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import load_config, local_profile_path
from eagle3_pipeline_tests.locations import location_file
from eagle3_pipeline_tests.pipeline_files import write_pipeline

REPO = Path(__file__).resolve().parents[2]
# A deployed pipeline whose endpoint needs a key the code location's environment does not set.
DEPLOYED = {
    "name": "deployed",
    "target": {"model": "m", "tokenizer": "t"},
    "inference": {
        "kind": "endpoints",
        "endpoints": [{"base_url": "http://127.0.0.1:9/v1", "api_key_env": "EAGLE3_UNSET_KEY"}],
    },
}


def test_loading_definitions_imports_no_heavy_library() -> None:
    code = (
        "import sys, eagle3_pipeline.definitions as d; "
        "d.defs.resolve_asset_graph(); "
        "print(sorted(m for m in ('torch', 'transformers', 'accelerate', 'gguf') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_dg_check_defs_in_a_fresh_shell(tmp_path: Path) -> None:
    """The README's check, with no variable set: the component YAML and the definitions load, and
    nothing warns (a code location name that differs from the project's would)."""
    out = subprocess.run(
        [str(Path(sys.executable).parent / "dg"), "check", "defs"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "All definitions loaded successfully" in out.stdout + out.stderr
    assert "WARNING" not in out.stdout + out.stderr and "Warning:" not in out.stdout + out.stderr, out.stderr


def test_asset_graph_partitions_and_lineage(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(local_profile_path())
    graph = build_definitions(config).resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys == {
        "target_model",
        "prompts",
        "responses",
        "training_data",
        "inference_server",
        "draft_vocab",
        "hidden_states",
        "eagle3_drafter",
        "drafter_eval",
    }
    for name in ("draft_vocab", "hidden_states"):
        node = graph.get(dg.AssetKey(name))
        assert node.group_name == "eagle3" and {p.to_user_string() for p in node.parent_keys} == {"training_data"}
    assert graph.get(dg.AssetKey("hidden_states")).pools == {"gpu"}
    drafter_eval = graph.get(dg.AssetKey("drafter_eval"))
    assert {p.to_user_string() for p in drafter_eval.parent_keys} == {"eagle3_drafter", "hidden_states", "draft_vocab"}
    assert graph.get_check_spec(dg.AssetCheckKey(dg.AssetKey("drafter_eval"), "tau_regression")).blocking
    responses = graph.get(dg.AssetKey("responses"))
    assert responses.partitions_def is not None and responses.partitions_def.get_partition_keys() == config.dataset_ids
    assert {p.to_user_string() for p in responses.parent_keys} == {"prompts", "target_model"}
    assert responses.pools == {"gpu"}
    assert {p.to_user_string() for p in graph.get(dg.AssetKey("training_data")).parent_keys} == {"responses"}


def test_jobs_schedule_and_automation(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(local_profile_path())
    defs = build_definitions(config)
    assert {j.name for j in defs.resolve_all_job_defs()} >= {"setup_job", "generation_job", "downstream_job"}
    downstream = defs.resolve_job_def("downstream_job")
    assert {k.to_user_string() for k in downstream.asset_layer.selected_asset_keys} == {
        "training_data",
        "draft_vocab",
        "hidden_states",
        "eagle3_drafter",
        "drafter_eval",
    }
    assert not list(defs.schedules or []), "the scheduled backfill is an automation condition, not a schedule"
    sensors = {s.name: s.default_status for s in defs.sensors or []}
    assert sensors == {
        "inference_health": dg.DefaultSensorStatus.STOPPED,
        "generation_stall": dg.DefaultSensorStatus.RUNNING,
        "pipeline_automation": dg.DefaultSensorStatus.RUNNING,
    }
    [automation] = [s for s in defs.sensors or [] if isinstance(s, dg.AutomationConditionSensorDefinition)]
    assert automation.emit_backfills, "a tick that requests several partitions emits one backfill"
    graph = defs.resolve_asset_graph()
    assert graph.get(dg.AssetKey("training_data")).automation_condition is not None
    assert graph.get(dg.AssetKey("responses")).automation_condition is None, (
        "no scheduled backfill unless the file sets schedule.cron"
    )

    scheduled = config.model_copy(update={"schedule": config.schedule.model_copy(update={"cron": "0 3 * * *"})})
    graph = build_definitions(scheduled).resolve_asset_graph()
    condition = graph.get(dg.AssetKey("responses")).automation_condition
    assert condition is not None and condition.get_label() == "scheduled backfill (0 3 * * * UTC)"
    assert graph.get(dg.AssetKey("prompts")).automation_condition == condition, "prompts join the same backfill"


def test_the_code_location_loads_without_its_runtime_environment(tmp_path: Path) -> None:
    """Missing source files and unset API-key variables do not stop the webserver or daemon from
    loading the definitions; the run that needs them reports them (see orchestration/test_launching.py)."""
    pipeline = write_pipeline(tmp_path, DEPLOYED, {"datasets": [{"id": "B1", "source": "/nonexistent/prompts.jsonl"}]})
    dagster = Path(sys.executable).parent / "dagster"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(
        # -d: the location file imports this checkout's package, as a deployment's imports its install
        [str(dagster), "definitions", "validate", "-f", str(location_file(tmp_path, pipeline)), "-d", str(REPO)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_runtime_checks_report_the_same_error_at_run_time(tmp_path: Path, monkeypatch) -> None:
    from eagle3_pipeline.config import ConfigError

    pipeline = write_pipeline(tmp_path, DEPLOYED, {"datasets": [{"id": "B1", "source": "prompts.jsonl"}]})
    monkeypatch.delenv("EAGLE3_UNSET_KEY", raising=False)
    config = load_config(pipeline, runtime_checks=False)
    with pytest.raises(ConfigError) as at_load:
        load_config(pipeline)
    assert f"{pipeline}: datasets[0] (id 'B1').source: file" in str(at_load.value)
    monkeypatch.setenv(
        "EAGLE3_UNSET_KEY", "set-while-the-missing-source-is-shown"
    )  # an unset key fails the run first (location/test_settings_resources.py)
    result = (
        build_definitions(config)
        .resolve_job_def("generation_job")
        .execute_in_process(partition_key="B1", instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    )
    failure = next(e for e in result.all_events if e.is_step_failure)
    refused = failure.step_failure_data.user_failure_data
    assert refused is not None and refused.description == str(at_load.value)
    (tmp_path / "prompts.jsonl").write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n')
    monkeypatch.delenv("EAGLE3_UNSET_KEY")
    with pytest.raises(
        ConfigError, match="inference.endpoints\\[0\\].api_key_env: environment variable EAGLE3_UNSET_KEY is not set"
    ):
        config.api_key(config.inference.endpoints[0])


def dg_project(root: Path, instances: dict[str, str]) -> Path:
    """A `dg` project `pipelines` in `root` whose defs folder holds one `Eagle3Pipeline` instance per
    item: folder name → the attributes' YAML (besides each, a pipeline file with dataset id `D<name>`)."""
    (root / "pyproject.toml").write_text(
        '[tool.dg]\ndirectory_type = "project"\n\n[tool.dg.project]\nroot_module = "pipelines"\n'
    )
    defs = root / "pipelines" / "defs"
    defs.mkdir(parents=True)
    (root / "pipelines" / "__init__.py").write_text("")
    (defs / "__init__.py").write_text("")
    for name, attributes in instances.items():
        inference = {"kind": "endpoints", "endpoints": [{"base_url": "http://127.0.0.1:9/v1"}]}
        sections = {"name": name, "target": {"model": "m", "tokenizer": "t"}, "inference": inference}
        write_pipeline(defs / name, sections, {"datasets": [{"id": f"D{name}", "source": "prompts.jsonl"}]})
        (defs / name / "defs.yaml").write_text(
            f"type: eagle3_pipeline.components.pipeline.Eagle3Pipeline\nattributes:\n{attributes}"
        )
    return root


def test_the_pipeline_component_loads_its_file_from_a_defs_folder(tmp_path: Path, monkeypatch) -> None:
    """A defs.yaml instances the pipeline with a file beside it; `artifacts_root` replaces the file's."""
    project = dg_project(tmp_path, {"a": "  config_file: pipeline.yaml\n  artifacts_root: /srv/eagle3\n"})
    monkeypatch.syspath_prepend(str(project))
    defs = dg.load_from_defs_folder(path_within_project=project)
    partitions = defs.resolve_asset_graph().get(dg.AssetKey("responses")).partitions_def
    assert partitions is not None and partitions.get_partition_keys() == ["Da"]
    resources = defs.resources
    assert resources is not None
    pipeline = resources["pipeline"]
    assert pipeline.config_path == str(project / "pipelines" / "defs" / "a" / "pipeline.yaml")
    assert str(pipeline.config().artifacts_root) == "/srv/eagle3"


def test_the_code_location_is_the_defs_folder_with_the_local_profile() -> None:
    """`eagle3_pipeline.definitions` is `load_from_defs_folder`: the component of defs/local/defs.yaml,
    built from the shipped local profile."""
    from eagle3_pipeline import definitions

    resources = definitions.defs.resources
    assert resources is not None and resources["pipeline"].config_path == str(local_profile_path())


def test_dg_lists_the_pipeline_component(tmp_path: Path) -> None:
    """`[tool.dg.project] registry_modules` registers the component type, so `dg list components`
    (and `dg scaffold defs`) know it."""
    dg_cli = Path(sys.executable).parent / "dg"
    out = subprocess.run(
        [str(dg_cli), "list", "components", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    keys = {item["key"] for item in json.loads(out.stdout)["items"]}
    assert "eagle3_pipeline.components.pipeline.Eagle3Pipeline" in keys
