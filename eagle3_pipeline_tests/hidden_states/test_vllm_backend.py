"""``hidden_states.backend: vllm`` against a loopback stand-in of ``vllm serve`` with
``extract_hidden_states`` (``vllm_standin.py``: a real HTTP server on 127.0.0.1 backed by transformers;
the only stand-in is for vLLM itself).

The stand-in writes what vLLM's connector writes: inputs of layers ``id + 1`` and the last layer's
output **before** the final norm. The backend's store must be byte-identical to the transformers
extractor's for the same samples (each sample alone there, as each request is alone here): which
layers, in which order, and the final norm applied by the backend as the target applies it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.config import HiddenStatesConfig
from eagle3_pipeline.hidden_states.capture import load_target
from eagle3_pipeline.hidden_states.extract import ExtractionError, run
from eagle3_pipeline.hidden_states.inputs import TrainingData, iter_rows
from eagle3_pipeline.hidden_states.store import HiddenStateStore
from eagle3_pipeline.hidden_states.vllm_capture import VllmError, first_difference
from eagle3_pipeline_tests.hidden_states.test_sglang_backend import (
    Recorder,
    assert_same_store,
    spec,
    training_data,
    transformers_spec,
)
from eagle3_pipeline_tests.hidden_states.vllm_standin import VllmStandin

NAME = "SmolLM2-135M-Instruct"
# SmolLM2-135M: 30 layers; the default aux ids [1, 14, 26] (output of layer) are vLLM's [2, 15, 27], then N = 30.
SERVED_LAYERS = [2, 15, 27, 30]


@pytest.fixture
def served(tmp_path: Path, local_model: Path) -> Iterator[tuple[VllmStandin, Path]]:
    """The stand-in writing to ``server-side/``; the extractor reads it through another path (a link)."""
    storage = tmp_path / "server-side"
    storage.mkdir()
    (tmp_path / "seen-here").symlink_to(storage)
    model = load_target(str(local_model), NAME, "cpu", "float32").model
    standin = VllmStandin(model, "smollm2", SERVED_LAYERS, storage).start()
    yield standin, tmp_path / "seen-here"
    standin.stop()


def vllm_spec(
    data: Path, output: Path, model: Path, standin: VllmStandin, folder: Path, **settings: Any
) -> dict[str, Any]:
    return spec(
        data,
        output,
        model,
        NAME,
        backend="vllm",
        vllm_base_url=standin.base_url,
        vllm_output_dir=str(folder),
        max_batch_size=4,
        **settings,
    )


@pytest.mark.local_model
@pytest.mark.slow
def test_the_vllm_backend_writes_the_transformers_extractors_bytes(
    tmp_path: Path, local_model: Path, served: tuple[VllmStandin, Path]
) -> None:
    standin, folder = served
    data = training_data(tmp_path / "training_data", 49152)
    report = Recorder()
    ours = run(vllm_spec(data, tmp_path / "vllm", local_model, standin, folder), report)
    run(transformers_spec(data, tmp_path / "transformers", local_model, NAME), Recorder())
    figures = assert_same_store(tmp_path / "vllm", tmp_path / "transformers")
    print(
        f"\n-- byte-identical stores (vLLM stand-in vs transformers, SmolLM2): {figures}, {ours['samples']} samples, "
        f"{ours['tokens']} tokens, {len(standin.requests)} requests"
    )
    assert ours["samples"] == 10 and ours["shards"] > 1
    assert ours["capture"] == {
        "backend": "vllm",
        "server_model": "smollm2",
        "family": "llama",
        "eagle_aux_hidden_state_layer_ids": SERVED_LAYERS,
        "teacher_norm": "model.norm.weight applied by the extractor to layer 30's state",
        "rms_norm_eps": json.loads((local_model / "config.json").read_text())["rms_norm_eps"],
    }
    assert HiddenStateStore(tmp_path / "vllm").manifest().capture == ours["capture"]
    assert ours["spot_check_passed"] and ours["spot_check_max_rel_error"] == 0.0 and ours["spot_check_samples"] == 2
    assert len(standin.requests) == 10 + 2
    assert all(
        r["max_tokens"] == 1 and r["return_token_ids"] is True and isinstance(r["prompt"], list)
        for r in standin.requests
    )
    assert sorted(p.name for p in folder.iterdir()) == [], "every connector file and lock is deleted once read"
    assert any("with the vLLM server at" in line for line in report.lines)


@pytest.mark.local_model
def test_a_server_that_runs_other_ids_or_layers_is_refused(
    tmp_path: Path, local_model: Path, served: tuple[VllmStandin, Path]
) -> None:
    standin, folder = served
    data = training_data(tmp_path / "training_data", 49152)
    first = next(iter_rows(TrainingData.open(data).folder / "train-00000.parquet", ["id", "input_ids"], 0))
    target = list(first["input_ids"])
    standin.rewrite_prompt = lambda ids: ids[:3] + [ids[3] + 1] + ids[4:] if ids == target else ids
    with pytest.raises(
        ExtractionError,
        match=rf"sample '{first['id']}': vLLM's prompt_token_ids differ from our input_ids at position 3 ",
    ):
        run(vllm_spec(data, tmp_path / "vllm", local_model, standin, folder), Recorder())
    assert sorted(p.name for p in folder.iterdir()) == [], "the refused request's file is read and deleted too"
    standin.rewrite_prompt, standin.layer_ids = None, SERVED_LAYERS[:3]
    with pytest.raises(
        VllmError,
        match=(
            r"hidden_states of shape \[\d+, 3, 576\], expected \[\d+, 4, 576\] "
            r".*eagle_aux_hidden_state_layer_ids \[2, 15, 27, 30\]"
        ),
    ):
        run(vllm_spec(data, tmp_path / "vllm", local_model, standin, folder, overwrite=True), Recorder())


def test_first_difference_and_the_settings_backend_vllm_needs() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 4], [1, 2, 3]) == 2
    assert first_difference([0, 1, 2, 3], [1, 2, 3]) == 0
    assert first_difference([1, 2], [1, 2, 3]) == 2
    with pytest.raises(
        ValueError, match=r"backend 'vllm' needs hidden_states.vllm_base_url .* and hidden_states.vllm_output_dir"
    ):
        HiddenStatesConfig(backend="vllm", vllm_base_url="http://127.0.0.1:8000/v1")
    assert (
        HiddenStatesConfig(backend="vllm", vllm_base_url="http://h:8000/v1", vllm_output_dir="/dev/shm/hs").backend
        == "vllm"
    )


def test_a_file_written_without_the_lock_is_read_once_it_parses(tmp_path: Path) -> None:
    """Older connectors save in place with no ``.lock``: a half-written file is retried, not misread."""
    import threading

    from safetensors.torch import save_file

    from eagle3_pipeline.hidden_states.vllm_capture import VllmTarget

    tensors = {
        "hidden_states": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
        "token_ids": torch.tensor([5, 6]),
    }
    save_file(tensors, str(tmp_path / "whole.safetensors"))
    path = tmp_path / "cmpl-1-0.safetensors"
    path.write_bytes((tmp_path / "whole.safetensors").read_bytes()[:40])
    threading.Timer(0.3, lambda: (tmp_path / "whole.safetensors").replace(path)).start()
    source = VllmTarget(None, "http://127.0.0.1:1/v1", "m", tmp_path, None, "llama", "model.norm.weight", None, 1e-5, 1)  # type: ignore[arg-type]
    found = source._read(path)
    assert torch.equal(found["hidden_states"], tensors["hidden_states"]) and torch.equal(
        found["token_ids"], tensors["token_ids"]
    )
    assert not path.exists()
