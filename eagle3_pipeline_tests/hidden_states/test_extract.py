"""The `extract` phase with the real tiny target (SmolLM2-135M-Instruct, the stand-in for the 1T
target) on real training_data shards: batching invariance, spot check, teacher convention, disk
refusal, identity mismatch, NaN reporting, kill -9 and resume, progress."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.hidden_states.capture import Target, batch_states, decoder_layers, load_target, reference_states
from eagle3_pipeline.hidden_states.extract import extract_shard, nothing_to_do, run
from eagle3_pipeline.hidden_states.extract_spec import ExtractionError, parse_spec
from eagle3_pipeline.hidden_states.resume import RESULT_FILE
from eagle3_pipeline.hidden_states.sharding import assign_shards, extraction_progress
from eagle3_pipeline.hidden_states.spot_check import spot_check
from eagle3_pipeline.hidden_states.store import AUX_KEY, HiddenStateStore
from eagle3_pipeline.hidden_states.vllm_capture import VllmError
from eagle3_pipeline.testing.extract_specs import extract_spec
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.training_data import sample_rows, write_training_data
from eagle3_pipeline.training_data.reader import TrainingData

pytestmark = [pytest.mark.slow, pytest.mark.local_model]

AUX = [1, 14, 26]
# Batching tolerance: CPU float32 compute, bf16 storage. The only difference between batchings is
# float32 reassociation (~1e-6 relative), so stored bf16 values may differ by at most one bf16 step
# where a value sits on a rounding boundary: relative L2 error per sample and tensor ≤ 1e-3.
BATCHING_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def target(local_model: Path) -> Target:
    return load_target(str(local_model), "SmolLM2-135M-Instruct", "cpu", "auto", False)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    train = [sample_rows("a", 4, seed=1, max_len=14), sample_rows("b", 2, seed=2, max_len=14)]
    return write_training_data(
        tmp_path / "training_data", {"train": train, "eval": [sample_rows("e", 2, seed=3, max_len=14)]}
    )


def spec(data: Path, output: Path, model: Path, **settings: Any) -> dict[str, Any]:
    """The embedded model on the CPU, shards of 30 tokens, one sample spot-checked unless ``settings`` say otherwise."""
    small = {"device": "cpu", "shard_tokens": 30, "spot_check_samples": 1}
    return extract_spec(data, output, model, "SmolLM2-135M-Instruct", **{**small, **settings})


def stored(root: Path) -> dict[str, tuple[Any, Any]]:
    return {s.sample_id: (s.aux_hidden_states, s.hidden_states) for s in HiddenStateStore(root).iter_samples()}


def rel(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_batch_composition_does_not_change_a_samples_states(data: Path, tmp_path: Path, local_model: Path) -> None:
    alone = run(spec(data, tmp_path / "bs1", local_model, max_batch_size=1, shard_tokens=1000), Recorder())
    batched = run(spec(data, tmp_path / "bs4", local_model, max_batch_size=4, shard_tokens=1000), Recorder())
    assert alone["samples"] == batched["samples"] == 8
    one, four = stored(tmp_path / "bs1"), stored(tmp_path / "bs4")
    assert one.keys() == four.keys()
    errors = [rel(four[k][i], one[k][i]) for k in one for i in (0, 1)]
    equal = sum(int((four[k][i] == one[k][i]).sum()) for k in one for i in (0, 1))
    values = sum(one[k][i].numel() for k in one for i in (0, 1))
    # docs/eagle3.md quotes this line (run with -s).
    print(f"batch 4 vs 1: largest relative L2 error {max(errors):.1e}, {equal / values:.2%} of bf16 values identical")
    assert max(errors) <= BATCHING_TOLERANCE, errors
    assert batched["spot_check_passed"] and batched["bytes_per_token_formula"] == 4 * 576 * 2 + 5


def test_teacher_is_the_final_norms_output_and_aux_ids_are_layer_outputs(target: Target) -> None:
    sequence = [1, 504, 3458, 28, 2377, 314, 260, 1345]
    caught: dict[int, Any] = {}
    layers = decoder_layers(target.model)
    handles = [layers[i].register_forward_hook(lambda _m, _i, out, i=i: caught.__setitem__(i, out)) for i in (*AUX, 29)]
    try:
        aux, hidden = reference_states(target, AUX, sequence)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(hidden, target.model.base_model.norm(caught[29])[0])
    assert torch.equal(aux, torch.cat([caught[i][0] for i in AUX], dim=-1))
    [(batch_aux, batch_hidden)] = batch_states(target, AUX, [sequence])
    assert torch.allclose(batch_aux, aux, atol=1e-5) and torch.allclose(batch_hidden, hidden, atol=1e-5)


def test_spot_check_fails_when_stored_states_differ(
    data: Path, tmp_path: Path, local_model: Path, target: Target
) -> None:
    out = tmp_path / "store"
    meta = run(spec(data, out, local_model, spot_check_samples=3), Recorder())
    assert meta["spot_check_passed"] and meta["spot_check_samples"] == 3 and meta["spot_check_max_rel_error"] < 0.01
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shard = out / "shard-00000.safetensors"
    with safe_open(str(shard), framework="pt") as handle:
        header = handle.metadata()
    tensors = load_file(str(shard))
    tensors[AUX_KEY] = tensors[AUX_KEY].roll(1, dims=0)  # states shifted by one token: a plausible bug
    save_file(tensors, str(shard), metadata=header)
    verdict = spot_check(HiddenStateStore(out), target, AUX, 8, 0.01)
    assert not verdict["spot_check_passed"] and verdict["spot_check_max_rel_error"] > 0.1


def test_refuses_when_the_disk_is_too_small_naming_both_numbers(data: Path, tmp_path: Path, local_model: Path) -> None:
    with pytest.raises(
        ExtractionError, match=r"bytes \(.* GB\) free, the phase will write about \d+ bytes .* × 4613 bytes/token"
    ):
        run(spec(data, tmp_path / "store", local_model, disk_margin=1e12), Recorder())
    assert not list((tmp_path / "store").glob("shard-*"))


def test_a_store_made_under_other_settings_is_refused_or_replaced(
    data: Path, tmp_path: Path, local_model: Path
) -> None:
    out = tmp_path / "store"
    run(spec(data, out, local_model, spot_check_samples=0), Recorder())
    with pytest.raises(
        ExtractionError, match=r"aux_layer_ids: store has \[1, 14, 26\], expected \[2, 14, 26\].*overwrite"
    ):
        run(spec(data, out, local_model, aux_layer_ids=[2, 14, 26], spot_check_samples=0), Recorder())
    meta = run(
        spec(data, out, local_model, aux_layer_ids=[2, 14, 26], spot_check_samples=0, overwrite=True), Recorder()
    )
    assert meta["shards_reused"] == 0 and HiddenStateStore(out).manifest().aux_layer_ids == [2, 14, 26]
    with pytest.raises(ExtractionError, match=r"extract spec: aux_layer_ids: .*expected 3 increasing"):
        parse_spec(spec(data, out, local_model, aux_layer_ids=[5, 3, 9]))


def test_nan_states_name_the_shard_and_sample(data: Path, tmp_path: Path, target: Target) -> None:
    shard = assign_shards(TrainingData.open(data), 30)[0]
    from eagle3_pipeline.training_data.reader import iter_rows

    rows = list(iter_rows(data / shard.source, ["id", "dataset", "input_ids", "loss_mask"]))[: len(shard.sample_ids)]
    weight = decoder_layers(target.model)[3].mlp.down_proj.weight
    saved = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] = float("nan")
    try:
        with pytest.raises(
            ExtractionError,
            match=(
                r"shard-00000 \(train, train-00000.parquet row 0\): sample "
                rf"{rows[0]['id']}: aux_hidden_states holds NaN"
            ),
        ):
            extract_shard(
                HiddenStateStore(tmp_path / "store"),
                target,
                parse_spec(spec(data, tmp_path, Path("m"))),
                AUX,
                shard,
                rows,
            )
    finally:
        with torch.no_grad():
            weight[0, 0] = saved
    assert not (tmp_path / "store" / "shard-00000.safetensors").exists()


CHILD = """
import json, sys, time
from eagle3_pipeline.hidden_states.extract import run
class Slow:
    def log(self, message): print(message, flush=True)
    def progress(self, metrics): time.sleep(30 if metrics["shards_done"] >= 2 else 0)
run(json.loads(sys.argv[1]), Slow())
"""


def test_kill_9_then_rerun_redoes_only_unfinished_shards(data: Path, tmp_path: Path, local_model: Path) -> None:
    out = tmp_path / "store"
    settings = spec(data, out, local_model, shard_tokens=15, spot_check_samples=0)
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(settings)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / "shard-00001.index.parquet").exists():
        assert child.poll() is None and time.monotonic() < deadline, "extraction ended before the kill"
        time.sleep(0.2)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    progress = extraction_progress(out)
    assert progress is not None and not progress.finished and progress.shards_done == 2 < progress.shards_total
    # A torn shard: tensors written, index missing (the kill landed between the two renames).
    (out / "shard-00001.index.parquet").unlink()
    report = Recorder()
    meta = run(settings, report)
    total = meta["shards"]
    assert meta["shards_reused"] == 1 and meta["shards_written"] == total - 1
    assert "extract: reusing shard-00000" in report.lines
    written = [line.split()[2] for line in report.lines if line.startswith("extract: wrote")]
    assert written == [f"shard-{n:05d}" for n in range(1, total)]
    progress = extraction_progress(out)
    assert meta["samples"] == 8 and progress is not None and progress.finished


def test_progress_reports_shards_tokens_and_bytes(data: Path, tmp_path: Path, local_model: Path) -> None:
    assert extraction_progress(tmp_path / "nothing") is None
    report = Recorder()
    meta = run(spec(data, tmp_path / "store", local_model, spot_check_samples=0), report)
    progress = extraction_progress(tmp_path / "store", now=time.time())
    assert progress is not None and progress.finished
    assert progress.shards_done == progress.shards_total == meta["shards"] and progress.tokens_done == meta["tokens"]
    assert abs(progress.bytes_per_token / 4613 - 1) < 0.05 and progress.last_write_age_s is not None
    assert [p["shards_done"] for p in report.points] == list(range(1, meta["shards"] + 1))


def test_a_complete_store_is_not_extracted_again_and_needs_no_state_source(
    data: Path, tmp_path: Path, local_model: Path
) -> None:
    """The rerun of a finished phase names a vLLM server where nothing listens (the backend is not part of
    the store's identity): it opens no source. Other check settings, or a shard gone, need the source again."""
    out = tmp_path / "store"
    first = run(spec(data, out, local_model, spot_check_samples=2), Recorder())
    dead = {"backend": "vllm", "vllm_base_url": "http://127.0.0.1:9/v1", "vllm_output_dir": str(tmp_path)}
    report = Recorder()
    again = run(spec(data, out, local_model, spot_check_samples=2, **dead), report)
    assert nothing_to_do(spec(data, out, local_model, spot_check_samples=2, **dead))
    assert again["shards_written"] == 0 and again["shards_reused"] == first["shards"] == again["shards"]
    assert {k: again[k] for k in ("spot_check_max_rel_error", "backend", "tokens", "bytes")} == {
        k: first[k] for k in ("spot_check_max_rel_error", "backend", "tokens", "bytes")
    }
    assert report.lines == [
        f"extract: {out} is complete for these settings ({first['shards']} shards, 8 samples): nothing to extract, "
        f"no state source opened; its checks as recorded when it was completed ({again['completed_at']})"
    ]
    assert not nothing_to_do(spec(data, out, local_model, spot_check_samples=3, **dead))
    with pytest.raises(VllmError, match=r"hidden_states.vllm_base_url 'http://127.0.0.1:9/v1': GET /models failed"):
        run(spec(data, out, local_model, spot_check_samples=3, **dead), Recorder())
    (out / "shard-00001.safetensors").unlink()
    assert not nothing_to_do(spec(data, out, local_model, spot_check_samples=2))
    meta = run(spec(data, out, local_model, spot_check_samples=2), Recorder())
    assert meta["shards_written"] == 1 and "completed_at" not in meta and (out / RESULT_FILE).is_file()
