"""The probe-window decision of a managed server's hang check (managed/hang.py): how many failed probes over
how long make a server hung, that UNKNOWN never counts, the default window scaled to the measured start,
and the settings' checks (the probe outlasts SGLang's own /health_generate wait; a health tick outlasts its
generation check). Plain arithmetic on probe outcomes; the probes themselves run against the SGLang stand-in in
managed/test_recovery.py and against the real vLLM in real_vllm/test_recovery_policy_vllm.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from eagle3_pipeline.config import HealthConfig, ServingConfig
from eagle3_pipeline.health import CheckResult, HealthReport, Status
from eagle3_pipeline.managed.hang import HangPolicy, HangWatch, probe_outcome

POLICY = HangPolicy(probes=3, window_s=60.0, probe_timeout_s=30.0)


def serving(**fields: Any) -> ServingConfig:
    return ServingConfig.model_validate({"managed": True, "model": "/m", **fields})


def test_three_failed_probes_over_the_window_make_the_server_hung() -> None:
    watch = HangWatch(POLICY)
    assert POLICY.spacing_s == 30 and watch.next_probe_at() == 0
    assert watch.add("failed", 0, 30, "no answer within 30 s") is None
    assert watch.next_probe_at() == 30
    assert watch.add("failed", 30, 60, "no answer within 30 s") is None
    assert watch.add("failed", 60, 90, "no answer within 30 s") == "hung"
    assert [p["outcome"] for p in watch.probes] == ["failed"] * 3
    assert watch.summary().startswith("3 probe(s): 3 failed in a row over 90.0 s, 0 could not tell")


def test_the_third_probe_on_schedule_decides_whatever_its_jitter() -> None:
    """Measured from the first failed probe's end, the third probe of a 24 s window ended 24 s later give or
    take milliseconds, and a tick 0.1 s slower than the others cost a fourth probe (12 s more stall)."""
    watch = HangWatch(HangPolicy(probes=3, window_s=24.0, probe_timeout_s=4.0))
    assert watch.add("failed", 0.002, 4.1, "no answer within 4 s") is None
    assert watch.add("failed", 12.0, 16.0, "no answer within 4 s") is None
    assert watch.add("failed", 24.0, 28.0, "no answer within 4 s") == "hung"


def test_failed_probes_faster_than_the_window_are_not_enough() -> None:
    watch = HangWatch(HangPolicy(probes=2, window_s=100.0, probe_timeout_s=5.0))
    assert watch.add("failed", 0, 5, "refused") is None
    assert watch.add("failed", 10, 15, "refused") is None, "two failed probes, but only 10 s apart"
    assert watch.add("failed", 100, 105, "refused") == "hung"


def test_one_answer_ends_the_check_and_the_server_serves() -> None:
    watch = HangWatch(POLICY)
    watch.add("failed", 0, 30, "no answer within 30 s (a long prefill)")
    assert watch.add("answered", 30, 31, "1-token completion in 0.9 s") == "serving"


def test_unknown_never_counts_and_at_the_bound_the_check_cannot_tell() -> None:
    watch = HangWatch(POLICY)
    assert POLICY.give_up_s == 150
    at = 0.0
    verdicts = []
    while not verdicts or verdicts[-1] is None:
        verdicts.append(watch.add("unknown", at, at + 30, "the shell probes did not answer"))
        at += POLICY.spacing_s
    assert verdicts[-1] == "unknown" and watch.failed == [] and len(watch.probes) == 5


def test_unknown_between_failed_probes_neither_counts_nor_breaks_the_run_of_failures() -> None:
    watch = HangWatch(POLICY)
    assert watch.add("failed", 0, 30, "x") is None
    assert watch.add("unknown", 30, 60, "tick ran out") is None
    assert watch.add("failed", 60, 90, "x") is None, "two failed: one short of three"
    assert watch.add("failed", 90, 120, "x") == "hung"


def test_the_default_window_scales_with_the_measured_start() -> None:
    kimi = serving(startup_timeout_s=3600)
    assert HangPolicy.of(kimi, start_s=1800).window_s == 450, "a quarter of a 30-minute reload"
    assert HangPolicy.of(kimi, start_s=None).window_s == 900, "a quarter of startup_timeout_s before a start"
    assert HangPolicy.of(kimi, start_s=20).window_s == 90, "at least hang_probes x hang_probe_timeout_s"
    assert "its measured start of 1800 s" in HangPolicy.of(kimi, start_s=1800).describe()
    explicit = HangPolicy.of(serving(hang_window_s=12, hang_probes=2, hang_probe_timeout_s=25), start_s=1800)
    assert (explicit.window_s, explicit.probes, explicit.probe_timeout_s) == (12, 2, 25)


def test_an_sglang_probe_shorter_than_its_own_health_wait_is_refused() -> None:
    with pytest.raises(
        ValidationError, match=r"hang_probe_timeout_s: 10 s, but sglang's own health route waits up to 20"
    ):
        serving(engine="sglang", hang_probe_timeout_s=10)
    assert serving(engine="vllm", hang_probe_timeout_s=3).hang_probe_timeout_s == 3
    assert serving().hang_probe_timeout_s > 20


def test_a_health_tick_shorter_than_its_generation_check_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"tick_timeout_s: 15 s, but the generation check may take"):
        HealthConfig(generation_timeout_s=30, tick_timeout_s=15)
    defaults = HealthConfig()
    assert defaults.generation_timeout_s > 20 and defaults.tick_timeout_s > defaults.generation_timeout_s


def report(**statuses: Status) -> HealthReport:
    checks = tuple(CheckResult(name, status, f"{name} said so", "box") for name, status in statuses.items())
    return HealthReport(checks, datetime.now(UTC))


def test_a_probe_is_answered_failed_or_unknown_from_its_tick() -> None:
    ok, warn, unknown, critical = Status.OK, Status.WARN, Status.UNKNOWN, Status.CRITICAL
    assert probe_outcome(report(server_process=ok, port=ok, generation=ok, gpus=critical))[0] == "answered"
    assert probe_outcome(report(server_process=ok, port=ok, generation=warn)) == (
        "answered",
        "generation warn: generation said so",
    ), "a 429 is a server that answers"
    assert probe_outcome(report(server_process=unknown, port=ok, generation=critical)) == (
        "failed",
        "server_process unknown: server_process said so; generation critical: generation said so",
    )
    assert probe_outcome(report(server_process=unknown, port=unknown, generation=ok))[0] == "unknown"
    assert probe_outcome(report(server_process=ok, port=ok)) == ("unknown", "the probe's checks did not report")
