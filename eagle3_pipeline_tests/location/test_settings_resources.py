"""Settings reach the runs through ConfigurableResources: a deployment's override of the pipeline
resource moves the outputs, and API keys arrive through `dg.EnvVar` fields resolved at run time.

Real Dagster runs on an ephemeral instance against the scripted OpenAI-compatible server on loopback.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.components.resources import PipelineResource
from eagle3_pipeline.config import load_config
from eagle3_pipeline.results import NO_LISTENER
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline_tests.dagster_runs import fake_server_sections
from eagle3_pipeline_tests.pipeline_files import write_pipeline

KEY_VAR = "EAGLE3_TEST_SETTINGS_KEY"
SECRET = "sk-test-settings-0123456789-SECRET"


def test_an_artifacts_root_set_on_the_resource_moves_the_outputs(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    path = write_pipeline(tmp_path, fake_server_sections(tmp_path, fake_openai, datasets=("B1",)))
    config = load_config(path, runtime_checks=False)
    deployed = tmp_path / "deployed"
    defs = build_definitions(config, PipelineResource(config_path=str(path), artifacts_root=str(deployed)))
    instance = dg.DagsterInstance.ephemeral()
    assert defs.resolve_job_def("generation_job").execute_in_process(partition_key="B1", instance=instance).success
    assert (deployed / "prompts" / "B1.parquet").exists() and (deployed / "responses" / "B1.parquet").exists()
    assert not (tmp_path / "out").exists(), "nothing is written under the file's artifacts_root"

    elsewhere = tmp_path / "elsewhere"
    overridden = {
        "pipeline": PipelineResource(config_path=str(path), artifacts_root=str(elsewhere)),
        "phase_listener": NO_LISTENER,
    }
    [prompts] = [
        a for a in defs.assets or [] if isinstance(a, dg.AssetsDefinition) and a.keys == {dg.AssetKey("prompts")}
    ]
    assert dg.materialize([prompts], partition_key="B1", instance=instance, resources=overridden).success
    assert (elsewhere / "prompts" / "B1.parquet").exists()


def test_the_key_comes_from_an_env_var_resolved_at_run_time(
    tmp_path: Path, fake_openai: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The definitions are built while the variable is unset; it is set only before the run."""
    monkeypatch.delenv(KEY_VAR, raising=False)
    path = write_pipeline(tmp_path, fake_server_sections(tmp_path, fake_openai, datasets=("B1",)))
    document = path.read_text().replace(
        f'"base_url": "{fake_openai.base_url}"', f'"base_url": "{fake_openai.base_url}", "api_key_env": "{KEY_VAR}"'
    )
    path.write_text(document)
    defs = build_definitions(load_config(path, runtime_checks=False))
    assert defs.resources is not None and defs.resources["inference"].api_keys.values == {KEY_VAR: dg.EnvVar(KEY_VAR)}

    monkeypatch.setenv(KEY_VAR, SECRET)
    instance = dg.DagsterInstance.ephemeral()
    result = defs.resolve_job_def("generation_job").execute_in_process(partition_key="B1", instance=instance)
    assert result.success
    assert fake_openai.headers_seen and all(
        h.get("Authorization") == f"Bearer {SECRET}" for h in fake_openai.headers_seen
    )
    log = "\n".join(dg.serialize_value(entry) for entry in instance.all_logs(result.run_id))
    assert "responses" in log and SECRET not in log, "the key is in no event, log line or metadata"


@pytest.mark.local_model
def test_an_unset_key_fails_only_the_runs_that_send_requests(
    tmp_path: Path, fake_openai: FakeOpenAI, local_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """training_data needs the target's tokenizer (the tiny real model's here), not the key."""
    monkeypatch.setenv(KEY_VAR, SECRET)
    path = write_pipeline(
        tmp_path,
        fake_server_sections(tmp_path, fake_openai, datasets=("B1",)),
        {"target": {"tokenizer": str(local_model)}},
    )
    keyed = path.read_text().replace(
        f'"base_url": "{fake_openai.base_url}"', f'"base_url": "{fake_openai.base_url}", "api_key_env": "{KEY_VAR}"'
    )
    path.write_text(keyed)
    instance = dg.DagsterInstance.ephemeral()
    defs = build_definitions(load_config(path, runtime_checks=False))
    assert defs.resolve_job_def("generation_job").execute_in_process(partition_key="B1", instance=instance).success

    monkeypatch.delenv(KEY_VAR)
    defs = build_definitions(load_config(path, runtime_checks=False))  # the definitions load
    failed = defs.resolve_job_def("generation_job").execute_in_process(
        partition_key="B1", instance=instance, raise_on_error=False
    )
    assert not failed.success
    errors = [error.to_string() for e in failed.all_events if (error := getattr(e.event_specific_data, "error", None))]
    assert any(f'environment variable "{KEY_VAR}" which is not set' in text for text in errors), errors
    assert not any(SECRET in text for text in errors)

    only_training_data = [dg.AssetKey("training_data")]
    downstream = defs.resolve_job_def("downstream_job").execute_in_process(
        instance=instance, asset_selection=only_training_data
    )
    assert downstream.success, "training_data does not need the key"
