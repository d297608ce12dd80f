"""The restart policy against a managed real vLLM (CPU build, the embedded model), with the real lifecycle,
recovery and generation engine:

- a stall: the server's whole process group SIGSTOPped while requests time out. Stopped until one hang-check
  probe failed, then continued (longer than one probe, shorter than the window): no restart; stopped until
  the check called it hung (past the window): exactly one restart. 0 answers lost, 0 written twice.
- a poison prompt: the plugin of tools/vllm-cpu (its test-only ``EAGLE3_TEST_POISON_MARKER``) makes the
  engine core exit, as a GPU fault does, on a prompt holding the marker; vLLM answers the requests in flight
  with an error and exits. Two restarts, the prompt quarantined with its reason in the errors file, every
  other prompt answered once; a second run does not send it.

Sized for CI: two server starts for the stall, three for the poison, on two quiet cores.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation import Endpoint, GenerationSummary, ResponseCheckpoint, generate
from eagle3_pipeline.managed import GenerationRecovery, ServerEvent, ServerPurpose, Supervisor, open_supervisor
from eagle3_pipeline.records import PromptRecord, content_id
from eagle3_pipeline.testing.generation_runs import lines, make_prompts, settings
from eagle3_pipeline.testing.process_groups import processes_of
from eagle3_pipeline.testing.process_tools import wait_until
from eagle3_pipeline.testing.real_vllm import DEFAULT_ENV, free_port, managed_serving
from eagle3_pipeline_tests.pipeline_files import load_pipeline

pytestmark = [pytest.mark.local_model, pytest.mark.timeout(1200)]

GENERATION = ServerPurpose.generation(needs_tools=False)
MARKER = "EAGLE3-POISON-PINEAPPLE"


def pipeline(
    folder: Path, python: Path, model: Path, env: dict[str, str] | None = None, **serving: Any
) -> PipelineConfig:
    sections = {
        "name": "recovery_policy_vllm",
        "target": {"model": "smol", "tokenizer": str(model), "max_seq_len": 2048},
        "serving": managed_serving(
            python,
            model,
            free_port(),
            folder / "logs",
            bind_host="127.0.0.1",
            stop_grace_s=10,
            restart_backoff_s=1,
            env={**DEFAULT_ENV, **(env or {})},
            **serving,
        ),
        "health": {"generation_timeout_s": 30},
    }
    return load_pipeline(folder, sections)


@contextmanager
def generation_server(config: PipelineConfig) -> Iterator[tuple[Supervisor, list[ServerEvent]]]:
    """The managed server started for generation and its events; stopped (verified) afterwards."""
    events: list[ServerEvent] = []
    with open_supervisor(config, on_event=events.append) as supervisor:
        assert supervisor is not None
        supervisor.ensure(GENERATION, "responses B1")
        try:
            yield supervisor, events
        finally:
            stopped = supervisor.release("test over")
            assert stopped is None or stopped.verified


def run(tmp_path: Path, supervisor: Supervisor, prompts: list[PromptRecord], **overrides: Any) -> GenerationSummary:
    recovery = GenerationRecovery(supervisor, GENERATION, "responses B1")
    endpoint = Endpoint(supervisor.server.setup.base_url, "smol")
    checkpoint = ResponseCheckpoint(tmp_path / "ck.jsonl", fsync="never")
    config = settings(**{"max_tokens": 16, "retry": {"max_attempts": 3, "backoff_initial_s": 0.5}, **overrides})
    return generate(
        prompts,
        lambda: [endpoint],
        settings=config,
        checkpoint=checkpoint,
        errors_path=tmp_path / "err.jsonl",
        recovery=recovery.hook(),
    )


def answered(tmp_path: Path) -> list[str]:
    return [r["id"] for r in lines(tmp_path / "ck.jsonl")] if (tmp_path / "ck.jsonl").exists() else []


def stall(pgid: int, until: Callable[[], bool], what: str) -> None:
    """SIGSTOP the server's group until ``until()`` holds, then SIGCONT it."""
    os.killpg(pgid, signal.SIGSTOP)
    try:
        wait_until(until, 600, what)
    finally:
        os.killpg(pgid, signal.SIGCONT)


def test_a_stall_shorter_than_the_window_keeps_the_server_and_a_longer_one_restarts_it_once(
    real_vllm_python: Path, local_model: Path, tmp_path: Path
) -> None:
    config = pipeline(
        tmp_path, real_vllm_python, local_model, hang_probes=3, hang_window_s=24, hang_probe_timeout_s=4, max_restarts=2
    )
    prompts = make_prompts(40)
    figures: dict[str, Any] = {}
    with generation_server(config) as (supervisor, events):
        record = supervisor.server.read_record()
        assert record is not None

        def probes(outcome: str) -> int:
            return sum(e.action == "probed" and e.metadata["outcome"] == outcome for e in events)

        def stalls() -> None:
            wait_until(lambda: len(answered(tmp_path)) >= 8, 600, "8 answers")
            figures["short_stall_at_rows"] = len(answered(tmp_path))
            stall(record.pgid, lambda: probes("failed") >= 1, "one failed probe")  # longer than one probe
            wait_until(lambda: probes("answered") >= 1, 600, "a probe answered after the short stall")
            wait_until(lambda: len(answered(tmp_path)) >= 24, 600, "24 answers")
            figures["long_stall_at_rows"] = len(answered(tmp_path))
            os.killpg(record.pgid, signal.SIGSTOP)  # until the check calls it hung: the recovery's stop kills it
            wait_until(lambda: any(e.action == "failed" for e in events), 600, "the hang decision")

        staller = threading.Thread(target=stalls, daemon=True)
        staller.start()
        summary = run(tmp_path, supervisor, prompts, read_timeout_s=4)
        staller.join(timeout=60)
        restarted = supervisor.server.read_record()
    ids = answered(tmp_path)
    figures.update(
        restarts=len(summary.restarts),
        restart=summary.restarts,
        rows=len(ids),
        lost=len({p.id for p in prompts} - set(ids)),
        duplicated=len(ids) - len(set(ids)),
        retries=summary.retries,
        resent_after_restart=summary.resent_after_restart,
        events=[(e.action, e.reason) for e in events],
    )
    print("\nstall figures: " + json.dumps(figures, indent=1))
    kept = [e for e in events if e.action == "kept"]
    assert kept and kept[0].reason.startswith("responses B1: serving: "), "the short stall kept the server"
    assert len(summary.restarts) == 1, "the long stall restarted it once"
    [restart] = summary.restarts
    assert restart["reason"].startswith("hung: ") and "3 failed in a row over" in restart["reason"]
    assert [p["outcome"] for p in restart["probes"]][-3:] == ["failed", "failed", "failed"]
    assert restart["probes"][-1]["at_s"] - restart["probes"][-3]["at_s"] >= 24 - 4
    assert len(ids) == len(set(ids)) == len(prompts) and summary.failed == 0, "0 lost, 0 duplicated"
    assert restarted is not None and restarted.pid != record.pid and processes_of(record.pgid) == []


def poison_prompt() -> PromptRecord:
    messages = [{"role": "user", "content": f"Repeat after me: {MARKER}"}]
    return PromptRecord(content_id(messages, None), "B1", messages, None, "short", 8, 999)  # type: ignore[arg-type]


def test_a_poison_prompt_that_crashes_vllm_is_quarantined_and_not_sent_again(
    real_vllm_python: Path, local_model: Path, tmp_path: Path
) -> None:
    env = {"EAGLE3_TEST_POISON_MARKER": MARKER}
    config = pipeline(
        tmp_path, real_vllm_python, local_model, env, hang_probes=2, hang_window_s=4, hang_probe_timeout_s=4
    )
    poison = poison_prompt()
    prompts = [*make_prompts(23), poison]
    with generation_server(config) as (supervisor, events):
        summary = run(tmp_path, supervisor, prompts)
        again = run(tmp_path, supervisor, prompts)
        log = Path(supervisor.server.log_path).read_text(errors="replace")
    ids = answered(tmp_path)
    errors = lines(tmp_path / "err.jsonl")
    figures = {
        "restarts": len(summary.restarts),
        "restart_reasons": [r["reason"] for r in summary.restarts],
        "rows": len(ids),
        "duplicated": len(ids) - len(set(ids)),
        "failed": summary.failed,
        "quarantined": summary.quarantined,
        "errors": errors,
        "resent_after_restart": summary.resent_after_restart,
        "second_run": {"quarantined_earlier": again.quarantined_earlier, "generated": again.generated},
        "starts": [e.action for e in events].count("started"),
        "poison_crashes_in_log": log.count("eagle3 test poison"),
    }
    print("\npoison figures: " + json.dumps(figures, indent=1))
    assert len(summary.restarts) <= 2 and log.count("eagle3 test poison") == len(summary.restarts)
    [error] = errors
    assert error["id"] == poison.id and error["quarantined"] is True
    assert error["reason"].startswith("quarantined: its request was in flight at 2 server crashes")
    assert (summary.failed, summary.quarantined) == (1, 1)
    assert len(ids) == len(set(ids)) == len(prompts) - 1 and poison.id not in ids, "every other prompt answered"
    assert (again.quarantined_earlier, again.generated, again.failed, again.restarts) == (1, 0, 0, [])
    assert [e.action for e in events].count("started") == 1 + len(summary.restarts)
