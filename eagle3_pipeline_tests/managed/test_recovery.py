"""The managed generation server brought back mid-generation (managed/recovery.py) with the real lifecycle,
the real generation engine and the SGLang stand-in of conftest as the engine (no SGLang engine, no GPU on
this machine): a kill -9 of the server's whole process group mid-generation → one restart, 0 lost and 0
duplicated answers; a hung server (its process alive, no generation) → hung after the probe window, stopped,
verified, then started; a server that keeps dying → the bounded restarts, then the run stops with the
restarts and the log's tail; a poison prompt that kills the server → two restarts, the prompt quarantined,
every other prompt answered, and the next run does not send it. The real-vLLM versions are
real_vllm/test_recovery_vllm.py and real_vllm/test_poison_vllm.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation import (
    Endpoint,
    GenerationSummary,
    RecoveryFailed,
    ResponseCheckpoint,
    ServerLost,
    generate,
)
from eagle3_pipeline.managed import GenerationRecovery, ServerEvent, ServerPurpose, Supervisor, open_supervisor
from eagle3_pipeline.testing.generation_runs import lines, make_prompts, settings
from eagle3_pipeline.testing.process_groups import processes_of
from eagle3_pipeline.testing.process_tools import free_port, wait_until
from eagle3_pipeline_tests.managed.pipelines import fake_sglang_serving
from eagle3_pipeline_tests.pipeline_files import load_pipeline

GENERATION = ServerPurpose.generation(needs_tools=False)
PROMPTS = 80


@pytest.fixture(scope="module", autouse=True)
def _one_process_table_module_at_a_time(process_table: None) -> None:
    """These tests start `python -m sglang.launch_server` stand-ins, which the health tests look for."""


def pipeline(tmp_path: Path, scenario: dict[str, Any], **serving: Any) -> PipelineConfig:
    section = fake_sglang_serving(tmp_path, **{"restart_backoff_s": 0, **serving})
    Path(section["env"]["FAKE_SGLANG_SCENARIO"]).write_text(json.dumps(scenario))
    return load_pipeline(tmp_path, {"serving": section, "health": {"generation_timeout_s": 2}})


@contextmanager
def generation_server(
    config: PipelineConfig, sleep: Callable[[float], None] | None = None
) -> Iterator[tuple[Supervisor, GenerationRecovery, list[ServerEvent]]]:
    """The managed server started for generation, its recovery hook and the events; stopped afterwards."""
    events: list[ServerEvent] = []
    with open_supervisor(config, on_event=events.append) as supervisor:
        assert supervisor is not None
        supervisor.ensure(GENERATION, "responses B1")
        recovery = GenerationRecovery(supervisor, GENERATION, "responses B1", sleep=sleep or time.sleep)
        try:
            yield supervisor, recovery, events
        finally:
            supervisor.release("test over")


def run(tmp_path: Path, supervisor: Supervisor, recovery: GenerationRecovery, **overrides: Any) -> GenerationSummary:
    endpoint = Endpoint(supervisor.server.setup.base_url, "target")
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl", fsync="never")
    config = settings(**{"retry": {"max_attempts": 1}, "max_consecutive_errors": 1, **overrides})
    return generate(
        make_prompts(PROMPTS),
        lambda: [endpoint],
        settings=config,
        checkpoint=checkpoint,
        errors_path=tmp_path / "err.jsonl",
        recovery=recovery.hook(),
    )


def checkpoint_ids(tmp_path: Path) -> list[str]:
    return [r["id"] for r in lines(tmp_path / "ck.jsonl")]


def test_a_server_killed_mid_generation_is_restarted_and_no_answer_is_lost_or_written_twice(tmp_path: Path) -> None:
    config = pipeline(tmp_path, {"delay_s": 0.05})
    with generation_server(config) as (supervisor, recovery, events):
        record = supervisor.server.read_record()
        assert record is not None
        before: list[int] = []

        def kill_mid_generation() -> None:
            wait_until(lambda: len(checkpoint_ids(tmp_path)) >= 20, 60, "20 answers")
            before.append(len(checkpoint_ids(tmp_path)))
            os.killpg(record.pgid, signal.SIGKILL)

        killer = threading.Thread(target=kill_mid_generation)
        killer.start()
        summary = run(tmp_path, supervisor, recovery)
        killer.join()
        restarted = supervisor.server.read_record()
        assert restarted is not None and restarted.pid != record.pid
    ids = checkpoint_ids(tmp_path)
    assert 20 <= before[0] < PROMPTS, "the kill landed mid-generation"
    assert len(ids) == len(set(ids)) == PROMPTS and set(ids) == {p.id for p in make_prompts(PROMPTS)}
    assert (summary.failed, summary.retries) == (0, 0) and summary.resent_after_restart >= 1
    [restart] = summary.restarts
    assert restart["restart"] == 1 and restart["outcome"] == "serving" and restart["duration_s"] > 0
    assert restart["reason"].startswith(("died: ", "orphaned: ", "hung: "))
    assert [e.action for e in events] == [
        "started",
        "failed",
        *(["stopped"] * (events[2].action == "stopped")),
        "started",
        "stopped",
    ]
    assert "restart 1 of at most 3" in events[-2].reason
    assert processes_of(record.pgid) == [] and processes_of(restarted.pgid) == []


def test_a_hung_server_is_stopped_verified_and_started_again(tmp_path: Path) -> None:
    config = pipeline(tmp_path, {"delay_s": 0.02}, hang_probes=2, hang_window_s=1)
    scenario = Path(config.serving.env["FAKE_SGLANG_SCENARIO"])

    def recovered_while_stopped(backoff_s: float) -> None:
        scenario.write_text(json.dumps({"delay_s": 0.02}))  # the next server generates again

    with generation_server(config, sleep=recovered_while_stopped) as (supervisor, recovery, events):
        record = supervisor.server.read_record()
        assert record is not None

        def hang_mid_generation() -> None:
            wait_until(lambda: len(checkpoint_ids(tmp_path)) >= 10, 60, "10 answers")
            scenario.write_text(json.dumps({"generate": "hang", "health_timeout_s": 0.5}))

        hanger = threading.Thread(target=hang_mid_generation)
        hanger.start()
        summary = run(tmp_path, supervisor, recovery, read_timeout_s=2)
        hanger.join()
    ids = checkpoint_ids(tmp_path)
    assert len(ids) == len(set(ids)) == PROMPTS and summary.failed == 0
    [restart] = summary.restarts
    assert restart["reason"].startswith("hung: ") and "generation" in restart["reason"]
    # hang_probes failed probes whose ends span the window: a third when the first probe took longer than the
    # second, so their ends fell short of it (managed/hang.py).
    failed = len(restart["probes"])
    assert f"{failed} failed in a row over" in restart["reason"] and "HTTP 503" in restart["reason"]
    assert failed >= 2 and [p["outcome"] for p in restart["probes"]] == ["failed"] * failed
    assert restart["probes"][1]["at_s"] >= 1, "the second probe waited for the window"
    actions = ["started", *["probed"] * failed, "failed", "stopped", "started", "stopped"]
    assert [e.action for e in events] == actions
    assert events[2 + failed].metadata["verified"] is True and processes_of(record.pgid) == []


def test_a_server_that_keeps_dying_stops_the_run_with_its_restarts_and_log_tail(tmp_path: Path) -> None:
    config = pipeline(tmp_path, {"crash_after": 15}, max_restarts=2)
    with generation_server(config) as (supervisor, recovery, events), pytest.raises(ServerLost) as caught:
        run(tmp_path, supervisor, recovery)
    message = str(caught.value)
    print(f"\n{message}")
    assert "failed again after 2 restart(s), the most serving.max_restarts = 2 allows in a run: died: " in message
    assert "Restarts: 1. after died: " in message and "; 2. after died: " in message
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in message
    assert f"Log {supervisor.server.log_path}, last lines:" in message
    summary = caught.value.summary
    ids = checkpoint_ids(tmp_path)
    assert len(ids) == len(set(ids)) == summary.generated and len(summary.restarts) == 2
    assert [e.action for e in events].count("started") == 3


def test_a_poison_prompt_is_quarantined_after_two_restarts_and_not_sent_again(tmp_path: Path) -> None:
    """The stand-in kills its group on a chat completion that holds the marker, as a GPU fault would."""
    prompts = make_prompts(PROMPTS)
    poison = prompts[PROMPTS // 2]
    config = pipeline(tmp_path, {"delay_s": 0.02, "poison": poison.messages[-1]["content"]}, max_restarts=3)
    with generation_server(config) as (supervisor, recovery, events):
        summary = run(tmp_path, supervisor, recovery, concurrency={"short": 8, "long": 2})
        again = run(tmp_path, supervisor, GenerationRecovery(supervisor, GENERATION, "responses B1 again"))
    ids = checkpoint_ids(tmp_path)
    [error] = lines(tmp_path / "err.jsonl")
    assert error["id"] == poison.id and error["quarantined"] is True and error["kind"] == "quarantined"
    assert "in flight at 2 server crashes (restarts 1 and 2" in error["reason"]
    assert len(summary.restarts) == 2 and (summary.failed, summary.quarantined) == (1, 1)
    assert len(ids) == len(set(ids)) == PROMPTS - 1 and poison.id not in ids, "every other prompt answered, once"
    assert summary.resent_after_restart >= 2
    assert (again.quarantined_earlier, again.generated, again.failed, again.restarts) == (1, 0, 0, [])
    assert [e.action for e in events].count("started") == 3


def test_a_host_that_cannot_be_reached_fails_the_recovery_with_one_message(tmp_path: Path) -> None:
    """Recovery on a GPU host whose sshd is gone (nothing listens on its port): RecoveryFailed naming the host
    and the SSH error, not a raw SSH exception out of the generation engine's hook."""
    host = {"kind": "ssh", "hostname": "127.0.0.1", "port": free_port(), "username": "eagle3", "allow_agent": False}
    section = fake_sglang_serving(tmp_path)
    config = load_pipeline(tmp_path, {"serving": section, "health": {"host": host}})
    with open_supervisor(config) as supervisor:
        assert supervisor is not None
        recovery = GenerationRecovery(supervisor, GENERATION, "responses B1", sleep=lambda _: None)
        with pytest.raises(RecoveryFailed) as caught:
            recovery("ServerLost: connection refused")
    message = str(caught.value)
    assert message.startswith(f"the managed server {supervisor.name} could not be recovered: "), message
    assert f"cannot connect to eagle3@127.0.0.1:{host['port']}" in message, message
