"""Fixtures for tests that need a Kimi-K2.5-shaped checkpoint: the tiny stand-in built by
:func:`eagle3_pipeline.testing.kimi.fixture.build_kimi_checkpoint`, once per test session (per
xdist worker). Tests elsewhere can import them (``from eagle3_pipeline_tests.kimi.conftest import
kimi_checkpoint  # noqa: F401``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_pipeline.testing.kimi.fixture import build_kimi_checkpoint


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
