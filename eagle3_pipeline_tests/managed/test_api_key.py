"""A managed server bound beyond loopback, keyed (`serving.bind_host` + `serving.api_key_env`), in a real Dagster
run on a temporary instance, with the SGLang stand-in as the engine (fake_sglang: no SGLang engine, no GPU here;
it takes the key from its `--config` YAML and refuses requests without it, as SGLang's API-key middleware does):

- the run's clients (readiness, preflight, generation) send the key; a request without it is refused;
- the key is in none of what the pipeline shows or keeps: no file under the test's folder (pid file, log, launch
  records, the run's outputs; the key file is gone once the engine read it), no run event, materialization or
  `inference_server` observation, no launch display, no `eagle3-pipeline server status` output."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import httpx
import pytest

from eagle3_pipeline.cli import main as cli_main
from eagle3_pipeline.components.pipeline import GENERATION_JOB, build_definitions
from eagle3_pipeline.config import ConfigError
from eagle3_pipeline.hosts import build_host
from eagle3_pipeline.managed import ManagedServer, ServerPurpose, launch_for, managed_server
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline_tests.managed.pipelines import fake_sglang_serving
from eagle3_pipeline_tests.pipeline_files import load_pipeline

KEY_VAR = "EAGLE3_TEST_SERVER_KEY"
KEY = "sk-managed-7f3a9c1e55d2b8"


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """These tests start `python -m sglang.launch_server` stand-ins, which the health tests look for."""


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as test_instance:
        yield test_instance


def test_a_keyed_server_refuses_keyless_requests_and_the_key_shows_nowhere(
    tmp_path: Path, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(KEY_VAR, KEY)
    serving = fake_sglang_serving(tmp_path, bind_host="0.0.0.0", api_key_env=KEY_VAR)
    Path(serving["env"]["FAKE_SGLANG_SCENARIO"]).write_text("{}")
    write_jsonl(tmp_path / "p.jsonl", [sharegpt(f"question {i}") for i in range(4)])
    config = load_pipeline(
        tmp_path,
        {
            "serving": serving,
            "generation": {"length_estimator": "chars", "max_tokens": 8, "concurrency": {"short": 2, "long": 1}},
            "health": {"max_truncation_rate": 1.0},
            "datasets": [{"id": "B1", "source": "p.jsonl"}],
        },
    )
    assert [(e.base_url, e.api_key_env) for e in config.inference.endpoints] == [
        (f"http://127.0.0.1:{serving['port']}/v1", KEY_VAR)
    ]
    setup = managed_server(config)
    assert setup is not None
    server = ManagedServer(build_host(setup.host), setup)
    shown: list[str] = []
    try:
        result = (
            build_definitions(config)
            .resolve_job_def(GENERATION_JOB)
            .execute_in_process(partition_key="B1", instance=instance, raise_on_error=False)
        )
        assert result.success
        [materialization] = result.asset_materializations_for_node("responses")
        assert materialization.metadata["rows"].value == 4, "the run's generation requests carried the key"

        chat = f"{config.inference.endpoints[0].base_url}/chat/completions"
        body = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(chat, json=body, timeout=10).status_code == 401, "no key: refused"
        keyed = httpx.post(chat, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert keyed.status_code == 200

        status = server.status()
        assert status.state == "running" and status.record is not None
        assert "--config" in status.record.argv and not Path(setup.serving.key_path).exists()
        assert cli_main(["server", "status", "--config", str(config.source_file)]) == 0
        shown.append(capsys.readouterr().out)
        shown.append(launch_for(config.target, setup, ServerPurpose.generation(needs_tools=False)).display())
        shown += [repr(entry) for entry in instance.all_logs(result.run_id)]
        records = instance.fetch_observations(dg.AssetKey("inference_server"), limit=50).records
        observations = [repr(r.asset_observation.metadata) for r in records if r.asset_observation is not None]
        assert any("started" in text for text in observations)
        preflight = [
            r.asset_observation.metadata["healthy"].value
            for r in records
            if r.asset_observation is not None and "healthy" in r.asset_observation.metadata
        ]
        assert preflight and preflight[0] is True, "the preflight's probe of the keyed server sent the key"
        shown += observations
        shown.append(repr(materialization.metadata))
    finally:
        server.stop("test over")
        server.host.close()
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert any(path.name.startswith("managed-") and path.suffix == ".log" for path in files)
    assert not [path for path in files if KEY.encode() in path.read_bytes()], "a file holds the key"
    assert not [text for text in shown if KEY in text], "a display, event or observation holds the key"
    assert len("".join(shown)) > 1000, "what was searched is not empty"


def test_a_bind_beyond_loopback_needs_a_key_from_the_environment(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"serving.bind_host: '0.0.0.0' opens the server .* set serving.api_key_env"):
        load_pipeline(tmp_path, {"serving": fake_sglang_serving(tmp_path, bind_host="0.0.0.0")})
    typed = fake_sglang_serving(tmp_path, extra_args=["--api-key", KEY])
    with pytest.raises(ConfigError, match=r"serving.extra_args: --api-key would put the key on the server's command"):
        load_pipeline(tmp_path, {"serving": typed})
    config = load_pipeline(
        tmp_path, {"serving": fake_sglang_serving(tmp_path, bind_host="10.0.0.5", api_key_env=KEY_VAR)}
    )
    setup = managed_server(config)
    assert setup is not None and setup.bind_host == "10.0.0.5"
    argv = launch_for(config.target, setup, ServerPurpose.generation(needs_tools=False)).argv
    assert argv[argv.index("--config") + 1] == setup.serving.key_path and KEY not in json.dumps(argv)


def test_a_keyed_vllm_extraction_server_is_refused(tmp_path: Path) -> None:
    """Its extractor reaches it on its own host's loopback, without a key."""
    serving = fake_sglang_serving(tmp_path, engine="vllm", bind_host="0.0.0.0", api_key_env=KEY_VAR)
    hidden = {"backend": "vllm", "model": "/models/target", "vllm_output_dir": str(tmp_path / "states")}
    with pytest.raises(ConfigError, match=r"serving.api_key_env: the managed vLLM server is also the extraction"):
        load_pipeline(tmp_path, {"serving": serving, "hidden_states": hidden})
