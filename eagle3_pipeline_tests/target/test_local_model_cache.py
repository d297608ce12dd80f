"""The embedded model's one-time conversion when several processes ask at once (test workers, a run
beside the tests): one converts, the others wait and find the folder ready.

The GGUF conversion itself (20 s of CPU) is replaced by a stand-in that writes the two files
`is_prepared` looks for, slowly enough for the callers to overlap.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from eagle3_pipeline.target import local_model


def test_concurrent_callers_convert_the_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conversions: list[Path] = []

    def slow_conversion(model_dir: Path) -> None:
        conversions.append(model_dir)
        time.sleep(0.5)
        model_dir.mkdir(parents=True)
        (model_dir / "config.json").write_text("{}")
        (model_dir / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(local_model, "_convert_gguf", slow_conversion)
    model_dir = tmp_path / "models" / "SmolLM2-135M-Instruct"
    results: list[tuple[Path, bool]] = []
    callers = [
        threading.Thread(target=lambda: results.append(local_model.prepare_local_model(model_dir))) for _ in range(3)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=30)

    assert len(conversions) == 1, "converted once"
    assert sorted(converted for _, converted in results) == [False, False, True]
    assert {folder for folder, _ in results} == {model_dir} and local_model.is_prepared(model_dir)
    assert local_model.prepare_local_model(model_dir) == (model_dir, False)
