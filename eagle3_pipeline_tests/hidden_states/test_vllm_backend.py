"""``hidden_states.backend: vllm`` in the states real vLLM cannot be put in, against a loopback stand-in of
``vllm serve`` with ``extract_hidden_states`` (``vllm_standin.py``: a real HTTP server on 127.0.0.1 backed
by transformers; the only stand-in is for vLLM itself): a server that does not run the ids as given, a
connector file written without its lock; and the layer-id evidence read from a process's command line
(a real process on loopback, no vLLM needed). The states against real vLLM, and its refusals, are
``eagle3_pipeline_tests/real_vllm/test_hidden_states.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.config import HiddenStatesConfig
from eagle3_pipeline.hidden_states.capture import SampleError, load_target
from eagle3_pipeline.hidden_states.extract import run
from eagle3_pipeline.hidden_states.vllm_capture import VllmError, first_difference, open_vllm_target, take_file
from eagle3_pipeline.hidden_states.vllm_server import extraction_url, layer_ids_in, served_layer_ids
from eagle3_pipeline.managed.launch import extraction_args, extraction_speculative_config
from eagle3_pipeline.testing.extract_specs import extract_spec
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.training_data import two_dataset_training_data
from eagle3_pipeline.training_data.reader import TrainingData, iter_rows
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
    model = load_target(str(local_model), NAME, "cpu", "float32", False).model
    standin = VllmStandin(model, "smollm2", SERVED_LAYERS, storage).start()
    yield standin, tmp_path / "seen-here"
    standin.stop()


def vllm_spec(
    data: Path, output: Path, model: Path, standin: VllmStandin, folder: Path, **settings: Any
) -> dict[str, Any]:
    return extract_spec(
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
def test_a_server_that_does_not_run_our_ids_is_refused_and_one_that_shows_no_ids_too(
    tmp_path: Path, local_model: Path, served: tuple[VllmStandin, Path]
) -> None:
    standin, folder = served
    data = two_dataset_training_data(tmp_path / "training_data", 49152)
    first = next(iter_rows(TrainingData.open(data).folder / "train-00000.parquet", ["id", "input_ids"], 0))
    target = list(first["input_ids"])
    standin.rewrite_prompt = lambda ids: ids[:3] + [ids[3] + 1] + ids[4:] if ids == target else ids
    with open_vllm_target(str(local_model), NAME, standin.base_url, str(folder), 4) as source:
        with pytest.raises(SampleError) as refused:
            source.batch_states([1, 14, 26], [[1, 2, 3], target])
        assert refused.value.index == 1 and refused.value.message.startswith(
            "vLLM's prompt_token_ids differ from our input_ids at position 3 "
        )
        assert sorted(p.name for p in folder.iterdir()) == [], "every file is read and deleted, the refused one's too"
        with pytest.raises(VllmError) as unproven:
            source.check_layers([1, 14, 26])
    message = str(unproven.value)
    print(f"\n-- a server whose command line shows no ids: {message}")
    port = urlsplit(standin.base_url).port
    assert f"cannot be proven: pid {os.getpid()} listening on port {port}: no --speculative-config" in message
    assert f"eagle_aux_hidden_state_layer_ids {SERVED_LAYERS}: start the server with --no-enable-chunked" in message
    with pytest.raises(VllmError, match=r"the store's aux layers .* start the server with"):
        run(vllm_spec(data, tmp_path / "vllm", local_model, standin, folder), Recorder())
    assert not (tmp_path / "vllm").exists(), "refused before the store is touched"


SERVER = """
import socket, sys, time
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
print(listener.getsockname()[1], flush=True)
time.sleep(120)
"""


def listening_process(*args: str) -> tuple[subprocess.Popen[str], int]:
    """A real process listening on a loopback port with ``args`` on its command line."""
    process = subprocess.Popen([sys.executable, "-c", SERVER, *args], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def test_the_layer_ids_are_read_from_the_command_line_of_the_process_on_the_port() -> None:
    ids = [2, 15, 27, 30]
    process, port = listening_process("--model", "m", *extraction_args(ids, "/dev/shm/hs"), "--api-key", "sk-secret")
    try:
        assert served_layer_ids("127.0.0.1", port) == (ids, process.pid)
        assert served_layer_ids("localhost", port) == (ids, process.pid)
    finally:
        process.kill()
        process.wait()
    assert served_layer_ids("127.0.0.1", port) == f"nothing listens on port {port} here"
    assert served_layer_ids("192.0.2.1", port) == (
        "'192.0.2.1' is not this machine, so the server's command line cannot be read here"
    )
    process, port = listening_process("--model", "m", "--api-key", "sk-secret")
    try:
        found = served_layer_ids("127.0.0.1", port)
    finally:
        process.kill()
        process.wait()
    assert found == f"pid {process.pid} listening on port {port}: no --speculative-config on its command line"


def test_the_speculative_config_is_read_as_vllm_parses_it_or_not_at_all() -> None:
    config = json.dumps(extraction_speculative_config([2, 15, 27, 30]))
    assert layer_ids_in(["--speculative-config", config]) == [2, 15, 27, 30]
    assert layer_ids_in([f"--speculative_config={config}"]) == [2, 15, 27, 30]
    assert layer_ids_in(["-sc", json.dumps(extraction_speculative_config([1])), "-sc", config]) == [2, 15, 27, 30]
    assert layer_ids_in(["--speculative-config.method", "extract_hidden_states"]) == (
        "it gives the speculative config as dotted flags (--speculative-config.method), not as one JSON value"
    )
    assert layer_ids_in(["--speculative", config]) == "it abbreviates --speculative-config as --speculative"
    assert layer_ids_in(["--speculative-config", '{"method": "eagle3"}']) == (
        "its --speculative-config is not JSON with draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids"
    )
    assert layer_ids_in(["-sc", '{"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": 2}}}']) == (
        "its eagle_aux_hidden_state_layer_ids 2 are not a list of integers"
    )
    assert layer_ids_in(["--config", "serve.yaml"]) == "no --speculative-config on its command line"


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

    tensors = {
        "hidden_states": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
        "token_ids": torch.tensor([5, 6]),
    }
    save_file(tensors, str(tmp_path / "whole.safetensors"))
    path = tmp_path / "cmpl-1-0.safetensors"
    path.write_bytes((tmp_path / "whole.safetensors").read_bytes()[:40])
    threading.Timer(0.3, lambda: (tmp_path / "whole.safetensors").replace(path)).start()
    found = take_file(path)
    assert torch.equal(found["hidden_states"], tensors["hidden_states"]) and torch.equal(
        found["token_ids"], tensors["token_ids"]
    )
    assert not path.exists()


def test_a_server_on_this_machine_is_reached_at_its_loopback() -> None:
    """A managed extraction server binds its host's 127.0.0.1, where the extractor runs (compute: ssh): the URL
    naming the host is reached at loopback there; another machine's URL is left as it is."""
    import socket

    name = socket.gethostname()
    assert extraction_url(f"http://{name}:8000/v1") == "http://127.0.0.1:8000/v1"
    assert extraction_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"
    assert extraction_url("http://gpu-box.test:8000/v1") == "http://gpu-box.test:8000/v1"
