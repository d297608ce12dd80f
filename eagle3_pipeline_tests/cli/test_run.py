"""`eagle3-pipeline run` executes the code location's own jobs as ordinary runs in its own process,
hears their progress and typed phase results through its listener, draws its progress bar on a
terminal from that progress and prints its summary from those results.

Here in the test process, against the scripted OpenAI-compatible server on loopback (a stand-in for the
target's server, slow enough for several progress snapshots) and small jobs that fail on demand. The command
as a real process on a pseudo-terminal — its bar, its summary, its runs re-executed as the UI would, a failure
in eagle3_drafter named with its WARN context — is `location/test_e2e.py`'s, in its main-job runs.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import dagster as dg
import pytest

from eagle3_pipeline.cli.cmd_run import MainJob
from eagle3_pipeline.components import build_definitions
from eagle3_pipeline.config import load_config
from eagle3_pipeline.hidden_states.draft_vocab import DraftVocabResult
from eagle3_pipeline.results import DrafterResult, HiddenStatesResult, PromptsResult, ResponsesResult, ResultError
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.fake_openai import FakeOpenAI


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_and_results_reach_the_cli_listener_in_process(tmp_path: Path) -> None:
    """One run of generation_job through `MainJob.execute`: the progress snapshots the asset body
    reports reach the bar, and the phases' typed results reach the listener, in this process."""
    server = FakeOpenAI(delay_s=0.05).start()
    try:
        write_jsonl(tmp_path / "p.jsonl", [sharegpt(f"Prompt number {i}") for i in range(20)])
        path = tmp_path / "pipeline.yaml"
        path.write_text(
            json.dumps(
                {
                    "name": "listener",
                    "artifacts_root": str(tmp_path / "out"),
                    "target": {"model": "fake", "tokenizer": "unused"},
                    "inference": {"kind": "endpoints", "endpoints": [{"base_url": server.base_url}]},
                    "generation": {
                        "max_tokens": 8,
                        "concurrency": 2,
                        "progress_interval_s": 0.1,
                        "length_estimator": "chars",
                    },
                    "datasets": [{"id": "B1", "source": str(tmp_path / "p.jsonl")}],
                }
            )
        )
        config = load_config(path)
        out = Terminal()
        with dg.DagsterInstance.ephemeral() as instance:
            job = MainJob(config, build_definitions(config), instance, out)
            job.execute("generation_job", "B1")
            [run] = instance.get_runs()
    finally:
        server.stop()
    assert (run.job_name, run.tags["dagster/partition"], run.tags["eagle3/entry"]) == ("generation_job", "B1", "cli")
    bars = [frame for frame in out.getvalue().split("\r") if frame.startswith("B1 [")]
    assert len(bars) >= 2 and "/20  " in bars[0], out.getvalue()
    assert bars[-1].startswith("B1 [" + "#" * 28 + "] 20/20"), "the final snapshot fills the bar"
    prompts = job.listener.require("prompts[B1]", PromptsResult)
    responses = job.listener.require("responses[B1]", ResponsesResult)
    assert (prompts.prompts, responses.rows, responses.generated_now) == (20, 20, 20)
    assert set(job.listener.results) == {"prompts[B1]", "responses[B1]"}


def test_the_summary_fails_loudly_on_a_result_that_lacks_a_field() -> None:
    """A result without a field its readers rely on is refused where it is made, naming the field;
    the summary reads typed fields, so a result of another type or none at all is an error, not a 0."""
    metadata = {"rows": 3, "generated_now": 3, "completion_tokens": 24, "data_version": "v"}
    with pytest.raises(ResultError, match=r"ResponsesResult: the phase's result lacks truncated"):
        ResponsesResult.from_metadata(metadata)
    with pytest.raises(ResultError, match=r"rows = '3' \(expected <class 'int'>\)"):
        ResponsesResult.from_metadata({**metadata, "truncated": 0, "rows": "3"})

    config = load_config(runtime_checks=False)
    first = config.dataset_ids[0]
    job = MainJob(config, None, dg.DagsterInstance.ephemeral(), io.StringIO())
    with pytest.raises(RuntimeError, match=rf"no prompts\[{first}\] result reached the summary"):
        job.summary(1.0)
    prompts = PromptsResult.from_metadata(
        {"prompts": 3, "records_read": 3, "short": 3, "long": 0, "estimated_prompt_tokens": 30}
    )
    job.listener.result("prompts", first, prompts)
    job.listener.result("responses", first, prompts)
    with pytest.raises(TypeError, match=rf"the result of responses\[{first}\] is a PromptsResult, not a Responses"):
        job.summary(1.0)


def test_the_summary_says_what_an_imported_store_and_a_resumed_drafter_do_not_report() -> None:
    """The importer writes every shard it finds (no written/reused split) and a drafter resumed at its
    last step trained none (no loss): the summary says so instead of printing zeros."""
    job = MainJob(load_config(runtime_checks=False), None, dg.DagsterInstance.ephemeral(), io.StringIO())
    figures = {"store": "/s", "samples": 6, "tokens": 60, "bytes": 6000, "bytes_per_token": 100.0}
    shape = {"bytes_per_token_formula": 100, "target_hidden_size": 8, "aux_layer_ids": [1, 2, 3], "shards": 2}
    job.listener.result("hidden_states", None, HiddenStatesResult.from_metadata({**figures, **shape}))
    job.listener.result(
        "draft_vocab",
        None,
        DraftVocabResult(4, 16, 0.9, 0.8, train_masked_tokens=50, distinct_masked_ids=5, training_data_version="v"),
    )
    drafter = {"steps": 5, "total_steps": 5, "first_loss": None, "last_loss": None, "export_dir": "/e"}
    job.listener.result("eagle3_drafter", None, DrafterResult.from_metadata(drafter))
    lines = job.eagle3_summary()
    assert "2 shards imported, in /s" in lines[1] and "written" not in lines[1]
    assert lines[2] == "eagle3_drafter: 5 steps, no step trained in this run, exported to /e"


def small_job(scenario: str) -> dg.Definitions:
    """`states` (whose WARN check always fails, as hidden_states' serving_agreement does when nothing was
    validated) → `drafter`, which fails in the way `scenario` says: an error, an interruption of its
    process, or not at all because a blocking ERROR check on `states` stops the run first."""

    @dg.asset
    def states() -> None:
        return None

    @dg.asset_check(asset=states, blocking=True)
    def serving_agreement() -> dg.AssetCheckResult:
        return dg.AssetCheckResult(
            passed=False, severity=dg.AssetCheckSeverity.WARN, description="not validated against the serving target"
        )

    @dg.asset_check(asset=states, blocking=True)
    def spot_check() -> dg.AssetCheckResult:
        passed = scenario != "check"
        return dg.AssetCheckResult(passed=passed, description="max relative error 0.3 (tolerance 0.01)")

    @dg.asset(deps=[states])
    def drafter() -> None:
        if scenario == "error":
            raise NotADirectoryError("[Errno 20] Not a directory: 'out/drafter/run'")
        if scenario == "interrupt":
            os.kill(os.getpid(), signal.SIGINT)  # the process is stopped, as Ctrl-C on `eagle3-pipeline run` does
            time.sleep(60)

    return dg.Definitions(
        assets=[states, drafter],
        asset_checks=[serving_agreement, spot_check],
        jobs=[dg.define_asset_job("downstream_job", selection=[states, drafter])],
    )


@pytest.mark.parametrize(
    ("scenario", "cause"),
    [
        ("error", "step drafter: NotADirectoryError: [Errno 20] Not a directory: 'out/drafter/run'"),
        ("interrupt", "step drafter was interrupted (its process was stopped)"),
        ("check", "check spot_check on states: max relative error 0.3 (tolerance 0.01)"),
    ],
)
def test_a_failed_run_names_its_cause_once_and_leaves_the_traceback_in_the_run_log(
    scenario: str, cause: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """The cause is the step that failed (or the blocking ERROR check that stopped the run); a WARN check
    that failed is context, on a line of its own. The terminal gets Dagster's headline of the failure,
    the run's event log keeps the error with its traceback."""
    with dg.DagsterInstance.ephemeral() as instance:
        job = MainJob(load_config(runtime_checks=False), small_job(scenario), instance, io.StringIO())
        with pytest.raises(RuntimeError) as raised:
            job.execute("downstream_job", None)
        [run] = instance.get_runs()
        failures = [e.dagster_event for e in instance.all_logs(run.run_id) if e.is_dagster_event]
    message = str(raised.value)
    first, also, where = message.splitlines()
    print(f"\n{scenario}:\n{message}")
    assert first == f"run {run.run_id} of downstream_job failed: {cause}"
    assert also == "  also failed, without stopping the run: check serving_agreement on states (WARN)"
    assert where.startswith(f"  error, traceback and logs: run {run.run_id} in the Dagster UI (DAGSTER_HOME=")
    terminal = capfd.readouterr().err
    assert "Stack Trace" not in terminal and "Traceback" not in terminal, terminal
    assert "STEP_FAILURE" in terminal and "(error and traceback: the run's event log)" in terminal, terminal
    [logged] = [e for e in failures if e is not None and e.is_step_failure]
    error = logged.step_failure_data.error
    assert error is not None and error.stack, "the traceback is in the run's event log"
