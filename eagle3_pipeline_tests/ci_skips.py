"""Under ``CI`` a skipped test is a failed one: ``.ci/run`` installs everything the suite needs (torch, the vLLM
venv, sshd, Chromium, PostgreSQL, the wheels read as source), so a skip there means a broken set-up that would
otherwise turn part of the suite green without running it. A test that must skip even in CI is named in
:data:`ALLOWED_SKIPS` with the reason; an entry whose test ran in CI without skipping fails the run too, so the
list cannot go stale. Outside ``CI`` (a developer's machine without the vLLM venv, say) skips stay skips."""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest
from pluggy import Result

# node id -> why it may skip in CI. Empty: every test runs in CI.
ALLOWED_SKIPS: dict[str, str] = {}

_ran_without_skipping: set[str] = set()


def under_ci() -> bool:
    return bool(os.environ.get("CI"))


def _failed_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = f"skipped under CI, which installs everything the suite needs: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Result[pytest.TestReport], None]:
    report = (yield).get_result()
    if not under_ci() or hasattr(report, "wasxfail"):
        return
    if report.skipped and item.nodeid not in ALLOWED_SKIPS:
        _failed_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Result[pytest.CollectReport], None]:
    """A module-level ``importorskip`` skips the whole module at collection: under CI that fails too."""
    report = (yield).get_result()
    if under_ci() and report.skipped and collector.nodeid not in ALLOWED_SKIPS:
        _failed_skip(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Seen on the controller for every worker's test: an allowed skip that ran to a pass or failure is stale."""
    if report.nodeid in ALLOWED_SKIPS and report.when == "call" and not report.skipped:
        _ran_without_skipping.add(report.nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if under_ci() and _ran_without_skipping and not hasattr(session.config, "workerinput"):
        stale = ", ".join(sorted(_ran_without_skipping))
        session.config.get_terminal_writer().line(f"ALLOWED_SKIPS lists tests that ran in CI without skipping: {stale}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
