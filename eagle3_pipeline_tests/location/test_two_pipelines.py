"""Two pipelines in one code location: two `Eagle3Pipeline` instances in a defs folder, the second with
a `key_prefix`. Real Dagster (`load_from_defs_folder`, a test instance, in-process runs); the only
stand-in is the inference server, a loopback fake of the OpenAI API (`eagle3_pipeline.testing.fake_openai`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from eagle3_pipeline.components.execution.deploy import with_executor
from eagle3_pipeline.config import ConfigError, load_config
from eagle3_pipeline.orchestration.names import PipelineNames
from eagle3_pipeline.orchestration.partition_runs import partitions_in_flight
from eagle3_pipeline.orchestration.staleness import partitions_to_generate
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline_tests.dagster_runs import Daemonless, sensor_resources
from eagle3_pipeline_tests.pipeline_files import write_pipeline, write_sources

OTHER = PipelineNames("other")


def write_instance(
    defs: Path, name: str, server: FakeOpenAI, attributes: str, deploy: dict[str, Any] | None = None
) -> Path:
    """A folder `name` in `defs` with a pipeline file (datasets `<name>1`, `<name>2`, artifacts under
    the folder, its `deploy:` section) and the defs.yaml that instances it."""
    folder = defs / name
    folder.mkdir(parents=True)
    sections = {
        "name": name,
        "target": {"model": "fake", "tokenizer": "unused"},
        "inference": {"kind": "endpoints", "endpoints": [{"base_url": server.base_url}]},
        "generation": {"max_tokens": 8, "concurrency": 2, "length_estimator": "chars"},
        "health": {"host": {"kind": "local"}},
        "datasets": write_sources(folder, f"{name}1", f"{name}2"),
        "deploy": deploy or {},
    }
    write_pipeline(folder, sections)
    (folder / "defs.yaml").write_text(
        "type: eagle3_pipeline.components.pipeline.Eagle3Pipeline\n"
        f"attributes:\n  config_file: pipeline.yaml\n{attributes}"
    )
    return folder


def make_project(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    server: FakeOpenAI,
    deploys: tuple[dict[str, Any], dict[str, Any]] = ({}, {}),
) -> Path:
    """A `dg` project whose defs folder holds `main` (no prefix) and `other` (key_prefix: other), with
    these `deploy:` sections. Its root module is named after the test, so no test loads another's module
    (and its server's port)."""
    module = "pipelines_" + re.sub(r"\W", "_", tmp_path.name)
    (tmp_path / "pyproject.toml").write_text(
        f'[tool.dg]\ndirectory_type = "project"\n\n[tool.dg.project]\nroot_module = "{module}"\n'
    )
    defs = tmp_path / module / "defs"
    defs.mkdir(parents=True)
    (tmp_path / module / "__init__.py").write_text("")
    (defs / "__init__.py").write_text("")
    write_instance(defs, "main", server, "", deploys[0])
    write_instance(defs, "other", server, "  key_prefix: other\n", deploys[1])
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_openai: FakeOpenAI) -> Path:
    return make_project(tmp_path, monkeypatch, fake_openai)


def keys_of(defs: dg.Definitions) -> set[dg.AssetKey]:
    return set(defs.resolve_all_asset_keys())


def test_two_instances_load_with_disjoint_names(project: Path) -> None:
    """Every asset, check, job, sensor and resource of the prefixed pipeline is namespaced; the other
    keeps the plain names."""
    defs = dg.load_from_defs_folder(path_within_project=project)
    phases = ["prompts", "responses", "training_data", "draft_vocab", "hidden_states", "eagle3_drafter", "drafter_eval"]
    plain = {dg.AssetKey(p) for p in phases} | {dg.AssetKey("inference_server")}
    prefixed = {OTHER.key(p) for p in phases} | {OTHER.key("inference_server")}
    assert plain | prefixed <= keys_of(defs)
    assert all(k in plain or k.path[0] == "other" for k in keys_of(defs))
    checks = set(defs.resolve_asset_graph().asset_check_keys)
    assert dg.AssetCheckKey(dg.AssetKey("responses"), "token_budget") in checks
    assert OTHER.check("responses", "token_budget") in checks
    assert OTHER.check("hidden_states", "spot_check") in checks
    assert all(c.asset_key in plain | prefixed for c in checks)
    jobs = {job.name for job in defs.jobs or []}
    assert {"generation_job", "downstream_job", "other__generation_job", "other__downstream_job"} <= jobs
    sensors = {sensor.name for sensor in defs.sensors or []}
    assert {"inference_health", "generation_stall", "pipeline_automation"} <= sensors
    assert {"other__inference_health", "other__generation_stall", "other__pipeline_automation"} <= sensors
    resources = defs.resources or {}
    assert {"pipeline", "inference", "other__pipeline", "other__inference", "other__phase_listener"} <= set(resources)
    assert resources["other__pipeline"].config().dataset_ids == ["other1", "other2"]
    graph = defs.resolve_asset_graph()
    other_partitions = graph.get(OTHER.key("responses")).partitions_def
    assert other_partitions is not None and other_partitions.get_partition_keys() == ["other1", "other2"]
    assert graph.get(OTHER.key("training_data")).parent_keys == {OTHER.key("responses")}
    assert (graph.get(dg.AssetKey("prompts")).group_name, graph.get(OTHER.key("prompts")).group_name) == (
        "data",
        "other__data",
    )


def test_the_prefixed_pipeline_runs_and_decides_on_its_own_records(project: Path) -> None:
    """The second pipeline's generation job writes under its own artifacts root and records on its own
    keys; the launch decision of each pipeline reads only its own materializations."""
    defs = dg.load_from_defs_folder(path_within_project=project)
    [folder] = project.glob("pipelines_*/defs")
    main = load_config(folder / "main" / "pipeline.yaml", runtime_checks=False)
    other = load_config(folder / "other" / "pipeline.yaml", runtime_checks=False)
    with dg.instance_for_test() as instance:
        job = defs.resolve_job_def("other__generation_job")
        assert job.execute_in_process(partition_key="other1", instance=instance).success
        assert (folder / "other" / "out" / "prompts" / "other1.parquet").exists()
        assert not (folder / "main" / "out").exists()
        assert instance.get_materialized_partitions(OTHER.key("prompts")) == {"other1"}
        assert instance.get_materialized_partitions(OTHER.key("responses")) == {"other1"}
        assert not instance.get_materialized_partitions(dg.AssetKey("responses"))
        assert partitions_to_generate(instance, other, OTHER) == {"other2": "missing"}
        assert partitions_to_generate(instance, main) == {"main1": "missing", "main2": "missing"}
        run = instance.create_run_for_job(job, tags={"dagster/partition": "other2"}, status=dg.DagsterRunStatus.STARTED)
        assert partitions_in_flight(instance, OTHER) == {"other2": run.run_id}
        assert partitions_in_flight(instance, PipelineNames("third")) == {}


def test_a_key_prefix_that_is_no_dagster_name_is_refused() -> None:
    with pytest.raises(ValueError, match="key_prefix"):
        PipelineNames("other/pipeline")


def test_each_health_sensor_launches_its_own_pipeline(project: Path) -> None:
    """The prefixed `inference_health` reads its own resource, launches its own generation job for its
    own partitions and records the health on its own `inference_server`; the plain one, ticked after,
    still sees its own partitions missing."""
    defs = dg.load_from_defs_folder(path_within_project=project)
    with dg.instance_for_test() as instance:
        other = Daemonless(defs, instance, sensor="other__inference_health")
        assert other.sensor.job_name == "other__generation_job"
        assert sorted(r.partition_key or "" for r in other.tick().run_requests or []) == ["other1", "other2"]
        assert instance.get_materialized_partitions(OTHER.key("responses")) == {"other1", "other2"}
        assert instance.fetch_observations(OTHER.key("inference_server"), limit=1).records
        assert not instance.fetch_observations(dg.AssetKey("inference_server"), limit=1).records
        assert "every responses partition is materialized and current" in (other.tick().skip_message or "")
        main = Daemonless(defs, instance)
        context = dg.build_sensor_context(
            instance=instance, definitions=defs, resources=sensor_resources(defs, main.sensor)
        )
        requests = main.sensor.evaluate_tick(context).run_requests or []
        assert sorted(r.partition_key or "" for r in requests) == ["main1", "main2"]


def _executors(defs: dg.Definitions) -> dict[str, str]:
    return {job.name: job.executor_def.name for job in defs.resolve_all_job_defs() if "generation_job" in job.name}


@pytest.mark.parametrize("kind", ["celery", "k8s"])
def test_two_pipelines_that_pick_the_same_executor_load_and_run_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_openai: FakeOpenAI, kind: str
) -> None:
    """Each component's definitions carry no executor (two would be two objects, which `Definitions.merge`
    refuses); the code location sets the one both files ask for, as definitions.py does."""
    pytest.importorskip({"celery": "dagster_celery", "k8s": "dagster_k8s"}[kind])
    project = make_project(tmp_path, monkeypatch, fake_openai, ({"executor": kind}, {"executor": kind}))
    loaded = dg.load_from_defs_folder(path_within_project=project)
    defs = with_executor(loaded)
    name = {"celery": "celery_executor", "k8s": "k8s"}[kind]
    assert _executors(defs) == {"generation_job": name, "other__generation_job": name}
    assert _executors(loaded) == {"generation_job": "multi_or_in_process_executor"} | {
        "other__generation_job": "multi_or_in_process_executor"
    }, "a component sets no executor of its own"


def test_two_pipelines_that_pick_different_executors_are_refused_naming_both_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_openai: FakeOpenAI
) -> None:
    pytest.importorskip("dagster_celery")
    project = make_project(tmp_path, monkeypatch, fake_openai, ({"executor": "celery"}, {}))
    [folder] = project.glob("pipelines_*/defs")
    with pytest.raises(ConfigError) as refused:
        with_executor(dg.load_from_defs_folder(path_within_project=project))
    message = str(refused.value)
    assert f"{folder / 'main' / 'pipeline.yaml'} asks for 'celery'" in message, message
    assert f"{folder / 'other' / 'pipeline.yaml'} asks for 'default'" in message, message
    assert "one executor" in message
