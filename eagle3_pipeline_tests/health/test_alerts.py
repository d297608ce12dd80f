"""Alerts against a real webhook receiver on loopback.

The health gate is the real one (probing this machine; made CRITICAL by a disk floor no disk meets),
ticked through the `inference_health` sensor on a real temporary instance; the budget alert comes from
a real `generation_job` run against the scripted OpenAI-compatible server. Every body the receiver
got, and every file of the Dagster instance and the artifacts, is scanned for the secrets in play:
the API key, the webhook URL's token and an SSH key passphrase.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest

from eagle3_pipeline.components.eagle3.drafter_eval import DRAFTER_EVAL
from eagle3_pipeline.components.pipeline import GENERATION_JOB, build_definitions
from eagle3_pipeline.config import load_config
from eagle3_pipeline.health.alerts import Alert, Alerter, health_changed
from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline.testing.webhook import Receiver
from eagle3_pipeline_tests.dagster_runs import fake_server_sections, sensor_resources, start_stalled_generation
from eagle3_pipeline_tests.pipeline_files import write_pipeline

URL_VAR, KEY_VAR, PASS_VAR = "EAGLE3_TEST_ALERT_URL", "EAGLE3_TEST_API_KEY", "EAGLE3_TEST_KEY_PASSPHRASE"
API_KEY = "sk-test-4f1d9c0b7e2a4c55a9d1"
TOKEN = "T0SECRET/B0SECRET/xoxb9f8e7d6c5b4a"
PASSPHRASE = "pass-phrase-7c1e0aa93b"


@contextmanager
def instance_in(home: Path) -> Iterator[dg.DagsterInstance]:
    """A temporary instance whose files all live in `home` (scanned for secrets afterwards)."""
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        yield instance


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    server = Receiver(TOKEN)
    monkeypatch.setenv(URL_VAR, server.url)
    monkeypatch.setenv(KEY_VAR, API_KEY)
    monkeypatch.setenv(PASS_VAR, PASSPHRASE)
    yield server
    server.stop()


def pipeline(
    tmp_path: Path, server: FakeOpenAI, disk_floor_gb: float, alert_format: str = "json", stall_window_s: float = 600
) -> Path:
    return write_pipeline(
        tmp_path,
        fake_server_sections(tmp_path, server, datasets=("B1",)),
        {
            "inference": {"kind": "endpoints", "endpoints": [{"base_url": server.base_url, "api_key_env": KEY_VAR}]},
            "health": {
                "host": {"key_file": "~/.ssh/unused_key", "key_passphrase_env": PASS_VAR},
                "min_disk_free_gb": disk_floor_gb,
                "stall_window_s": stall_window_s,
            },
            "alerts": {"webhook_url_env": URL_VAR, "format": alert_format},
        },
    )


def tick_health(config_path: Path, instance: dg.DagsterInstance) -> None:
    defs = build_definitions(load_config(config_path, runtime_checks=False))
    sensor = defs.resolve_sensor_def("inference_health")
    sensor.evaluate_tick(
        dg.build_sensor_context(instance=instance, definitions=defs, resources=sensor_resources(defs, sensor))
    )


def assert_no_secret(receiver: Receiver, *folders: Path) -> None:
    secrets = [API_KEY, TOKEN, TOKEN.split("/")[-1], PASSPHRASE, receiver.url]
    for body in receiver.bodies:
        text = json.dumps(body)
        assert not [s for s in secrets if s in text], text
    for folder in folders:
        for file in (f for f in folder.rglob("*") if f.is_file()):
            data = file.read_bytes()
            assert not [s for s in secrets if s.encode() in data], f"a secret is in {file}"


def test_health_alert_on_change_only_with_the_report_and_no_secret(
    tmp_path: Path, fake_openai: FakeOpenAI, receiver: Receiver
) -> None:
    def sick() -> Path:
        return pipeline(tmp_path, fake_openai, disk_floor_gb=1e9)

    with instance_in(tmp_path / "home") as instance:
        tick_health(sick(), instance)
        assert len(receiver.bodies) == 1
        tick_health(sick(), instance)
        assert len(receiver.bodies) == 1, "still CRITICAL: no second message"
        tick_health(pipeline(tmp_path, fake_openai, disk_floor_gb=0.01), instance)
        assert len(receiver.bodies) == 1, "recovery is recorded, not announced"
        tick_health(sick(), instance)
        assert len(receiver.bodies) == 2, "CRITICAL again after a recovery: a new message"

    first = receiver.bodies[0]
    print("received:", json.dumps(first, indent=1, ensure_ascii=False))
    assert first["kind"] == "health" and first["state"] == "critical"
    assert first["title"].startswith("[eagle3 orchestrated] health gate CRITICAL on localhost")
    assert "| disk | CRITICAL |" in first["report"] and "| generation | OK |" in first["report"]
    assert receiver.paths == [f"/hooks/{TOKEN}"] * 2
    assert_no_secret(receiver, tmp_path / "home", tmp_path / "out")


def test_secrets_in_a_report_are_masked_before_sending(
    tmp_path: Path, fake_openai: FakeOpenAI, receiver: Receiver
) -> None:
    config = load_config(
        pipeline(tmp_path, fake_openai, disk_floor_gb=0.01, alert_format="slack"), runtime_checks=False
    )
    leaky = f"probe failed: curl -H 'Authorization: Bearer {API_KEY}' {receiver.url} (passphrase {PASSPHRASE})"
    assert Alerter.for_pipeline(config, pytest.fail).send(Alert("stall", "stall:B1:r", "stalled", "stall: B1", leaky))
    [body] = receiver.bodies
    assert (
        set(body) == {"text"} and "probe failed: curl -H 'Authorization: Bearer [redacted]' [redacted]" in body["text"]
    )
    assert_no_secret(receiver)


def test_unset_webhook_variable_turns_alerts_off_with_one_warning(
    tmp_path: Path, fake_openai: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(URL_VAR, raising=False)
    config = load_config(pipeline(tmp_path, fake_openai, disk_floor_gb=1e9), runtime_checks=False)
    warnings: list[str] = []
    from eagle3_pipeline.health.gate import HealthMonitor

    report, _ = HealthMonitor(config).tick()
    assert not health_changed(Alerter.for_pipeline(config, warnings.append), report)
    assert not health_changed(Alerter.for_pipeline(config, warnings.append), report)
    assert warnings == [
        f"alert not sent (health gate CRITICAL on localhost: {report.summary()}): alerts are off because "
        f"environment variable {URL_VAR} is not set"
    ]


def test_budget_reached_alerts_once_from_the_responses_run(
    tmp_path: Path, fake_openai: FakeOpenAI, receiver: Receiver
) -> None:
    path = pipeline(tmp_path, fake_openai, disk_floor_gb=0.01)
    document = json.loads(path.read_text())
    document["datasets"][0]["token_budget"] = 6  # the fake answers 5 completion tokens per prompt: two answers reach it
    path.write_text(json.dumps(document))
    defs = build_definitions(load_config(path))
    with instance_in(tmp_path / "home") as instance:
        for _ in range(2):
            assert (
                defs.resolve_job_def(GENERATION_JOB).execute_in_process(partition_key="B1", instance=instance).success
            )
    [body] = receiver.bodies
    assert body["kind"] == "budget" and body["title"] == "[eagle3 orchestrated] token budget reached for B1"
    assert "token_budget: 6" in body["report"] and "budget_tokens: 10" in body["report"]
    assert_no_secret(receiver, tmp_path / "home", tmp_path / "out")


def test_tau_regression_alerts_when_drafter_evals_check_fails(
    tmp_path: Path, fake_openai: FakeOpenAI, receiver: Receiver
) -> None:
    """The `tau_regression` check runs for real over two recorded drafter_eval materializations
    (reported to the instance here: training a drafter is other tests' business)."""
    defs = build_definitions(load_config(pipeline(tmp_path, fake_openai, disk_floor_gb=0.01), runtime_checks=False))
    check = dg.define_asset_job(
        "tau_check", selection=dg.AssetSelection.checks(dg.AssetCheckKey(DRAFTER_EVAL, "tau_regression"))
    )
    job = dg.Definitions.merge(defs, dg.Definitions(jobs=[check])).resolve_job_def("tau_check")
    with instance_in(tmp_path / "home") as instance:
        for tau in (2.6, 2.1):
            instance.report_runless_asset_event(
                dg.AssetMaterialization(DRAFTER_EVAL, metadata={"tau@3": tau, "tau@3/B1": tau})
            )
            job.execute_in_process(instance=instance, raise_on_error=False)
            job.execute_in_process(instance=instance, raise_on_error=False)
    [body] = receiver.bodies
    assert body["kind"] == "tau_regression" and body["title"] == "[eagle3 orchestrated] drafter τ regressed"
    assert "tau@3" in body["report"] and "2.1" in body["report"] and "2.6" in body["report"], body["report"]
    assert_no_secret(receiver, tmp_path / "home")


def test_stall_alerts_once_per_stalled_run(tmp_path: Path, fake_openai: FakeOpenAI, receiver: Receiver) -> None:
    """A started generation run whose checkpoint stopped growing (as in the health tests' stall case),
    seen by the real `generation_stall` sensor on two ticks."""
    config = load_config(pipeline(tmp_path, fake_openai, disk_floor_gb=0.01, stall_window_s=1), runtime_checks=False)
    defs = build_definitions(config)
    with instance_in(tmp_path / "home") as instance:
        run = start_stalled_generation(defs, instance, config.artifacts_root)
        sensor = defs.resolve_sensor_def("generation_stall")
        for _ in range(2):
            sensor.evaluate_tick(
                dg.build_sensor_context(instance=instance, definitions=defs, resources=sensor_resources(defs, sensor))
            )
    [body] = receiver.bodies
    assert body["kind"] == "stall" and body["subject"] == f"stall:B1:{run.run_id}"
    assert body["report"].startswith(f"B1 (run {run.run_id[:8]}, no new response for ")
    assert_no_secret(receiver, tmp_path / "home", tmp_path / "out")
