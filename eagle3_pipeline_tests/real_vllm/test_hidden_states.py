"""``hidden_states.backend: vllm`` against real vLLM (CPU build, bf16) on the embedded model (SmolLM2-135M-Instruct,
30 layers, for the 1T target): the states against the transformers extractor's, the validation against the live
target, the layer ids proven from the server's command line, rows of another tokenizer, and a finished phase rerun
with the extraction server stopped.

Two servers, each started once for the module (at most both alive): ``extraction``, started as the store needs
(ids [2, 15, 27, 30] for the default aux layers [1, 14, 26] and layer N = 30, served as ``smol``, not under the
target's name), and ``shifted`` ([3, 15, 27, 29]: the first aux layer and the teacher one layer early). The last
test stops ``extraction``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import dagster as dg
import httpx

from eagle3_pipeline.components.eagle3.hidden_states import build_eagle3_assets
from eagle3_pipeline.config import ServingValidationConfig, load_config
from eagle3_pipeline.hidden_states.capture import load_target
from eagle3_pipeline.hidden_states.extract import run
from eagle3_pipeline.hidden_states.extract_spec import ExtractionError, parse_spec
from eagle3_pipeline.hidden_states.store import HiddenStateStore
from eagle3_pipeline.hidden_states.validation import validate_first
from eagle3_pipeline.hidden_states.vllm_capture import VllmError, open_vllm_target, reply_file_taker
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed.launch import extraction_args
from eagle3_pipeline.testing.real_vllm import RunningVllm, stop_group, vllm_server
from eagle3_pipeline.testing.reference_texts import TEXTS, other_tokenizer, reference_of
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.training_data import write_training_data
from eagle3_pipeline.training_data.agreement import ServerEndpoint
from eagle3_pipeline.training_data.reader import TrainingData
from eagle3_pipeline.training_data.serving_reference import record_from_first
from eagle3_pipeline_tests.dagster_runs import pipeline_resources
from eagle3_pipeline_tests.pipeline_files import TINY_TARGET, write_pipeline

pytestmark = pytest.mark.local_model

NAME = "SmolLM2-135M-Instruct"
SERVED = "smol"
AUX = [1, 14, 26]  # the default for 30 layers (output of layer)
LAYERS = [2, 15, 27, 30]  # vLLM's ids for them, then N
SHIFTED = [3, 15, 27, 29]
SETTINGS = ServingValidationConfig(samples=4, min_agreement=0.9, near_tie_logprob_margin=0.2)
MORE_TEXTS = [
    "The mitochondria is the powerhouse of the cell: it turns the energy in food into a form the cell can use, "
    "and it has its own small genome inherited from the mother.",
    "SELECT name, count(*) FROM orders JOIN customers ON orders.customer_id = customers.id GROUP BY name "
    "ORDER BY count(*) DESC LIMIT 10;",
    "Dear team, the release is moved to Thursday because two tests still fail on the build machine. Please "
    "review the open pull requests before Wednesday evening.",
    "In 1969 two astronauts walked on the Moon while a third orbited above them; they brought back rocks "
    "that scientists still study today.",
]


@dataclass(frozen=True)
class Extraction:
    server: RunningVllm
    folder: Path


def started(local_model: Path, root: Path, layers: list[int]) -> Iterator[Extraction]:
    folder = root / "states"
    folder.mkdir()
    with vllm_server(
        local_model, root / "vllm.log", served_name=SERVED, extra_args=extraction_args(layers, folder)
    ) as server:
        yield Extraction(server, folder)


@pytest.fixture(scope="module")
def extraction(
    real_vllm_python: Path, local_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Extraction]:
    yield from started(local_model, tmp_path_factory.mktemp("extraction"), LAYERS)


@pytest.fixture(scope="module")
def shifted(
    real_vllm_python: Path, local_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Extraction]:
    yield from started(local_model, tmp_path_factory.mktemp("shifted"), SHIFTED)


def rows_data(folder: Path, tokenizer: Any) -> Path:
    """Real text, one row per text: the last two are the eval split."""
    rows = []
    for i, text in enumerate(TEXTS + MORE_TEXTS):
        ids = tokenizer.encode(text, add_special_tokens=False)
        mask = [0] * 4 + [1] * (len(ids) - 4)
        rows.append(
            {
                "id": f"s{i:03d}",
                "dataset": "B1",
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": len(ids),
                "num_masked": sum(mask),
            }
        )
    return write_training_data(folder, {"train": [rows[:-2]], "eval": [rows[-2:]]})


def vllm_spec(data: Path, output: Path, model: Path, at: Extraction, **settings: Any) -> dict[str, Any]:
    return {
        "training_data": str(data),
        "output": str(output),
        "model": str(model),
        "target_name": NAME,
        "backend": "vllm",
        "vllm_base_url": at.server.base_url,
        "vllm_output_dir": str(at.folder),
        "shard_tokens": 60,
        "spot_check_samples": 2,
        "max_batch_size": 4,
        "validation": SETTINGS.model_dump(),
        "serving_reference": str(reference_of(data)),
        **settings,
    }


def record(data: Path, at: Extraction, tokenizer: str) -> str:
    """The serving reference of ``data`` recorded from the server, as the preflight records it."""
    done = record_from_first(
        data,
        [ServerEndpoint(at.server.base_url, SERVED)],
        tokenizer_name=tokenizer,
        trust_remote_code=False,
        settings=SETTINGS,
        out=reference_of(data),
        after_reply=reply_file_taker(at.folder),
    )
    return str(done["serving_reference_status"])


@dataclass(frozen=True)
class Materialized:
    config: Path
    meta: dict[str, Any]
    checks: dict[str, tuple[bool, str]]
    logs: list[str]


def materialize(config_path: Path) -> Materialized:
    """The ``hidden_states`` asset on a real (ephemeral) Dagster instance."""
    config = load_config(config_path)
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize(
        build_eagle3_assets(config),
        selection=["hidden_states"],
        instance=instance,
        resources=pipeline_resources(config_path),
        raise_on_error=False,
    )
    logs = [entry.user_message for entry in instance.all_logs(result.run_id)]
    assert result.success, "\n".join(logs[-20:])
    [materialization] = result.asset_materializations_for_node("hidden_states")
    checks = {e.check_name: (e.passed, e.description or "") for e in result.get_asset_check_evaluations()}
    return Materialized(config_path, {k: v.value for k, v in materialization.metadata.items()}, checks, logs)


@pytest.fixture(scope="module")
def pipeline(extraction: Extraction, local_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Materialized:
    """The asset through the extraction server: the preflight records the serving reference from it, the phase
    proves its ids, validates and extracts."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("pipeline")
    hidden_states = {
        "backend": "vllm",
        "model": str(local_model),
        "vllm_base_url": extraction.server.base_url,
        "vllm_output_dir": str(extraction.folder),
        "shard_tokens": 60,
        "spot_check_samples": 2,
        "max_batch_size": 4,
        "validation": SETTINGS.model_dump(include={"samples", "min_agreement", "near_tie_logprob_margin"}),
    }
    path = write_pipeline(root, TINY_TARGET, {"hidden_states": hidden_states})
    rows_data(
        ArtifactLayout(load_config(path).artifacts_root).training_data, AutoTokenizer.from_pretrained(local_model)
    )
    return materialize(path)


def test_the_phase_through_real_vllm_proves_the_ids_validates_and_leaves_no_file(
    pipeline: Materialized, extraction: Extraction
) -> None:
    meta, checks = pipeline.meta, pipeline.checks
    status = meta["serving_reference_status"]
    print(f"\n-- serving reference: {status}")
    print(f"-- serving_agreement: {checks['serving_agreement'][1]}")
    print(f"-- spot_check: {checks['spot_check'][1]}")
    print(f"-- bytes_per_token: {checks['bytes_per_token'][1]}")
    assert status.startswith(f"recorded from {extraction.server.base_url} (vllm): 4 samples"), status
    assert all(passed for passed, _ in checks.values()), checks
    assert meta["serving_agreement"] >= 0.95 and meta["serving_positions"] > 100
    assert meta["capture"]["eagle_aux_hidden_state_layer_ids"] == LAYERS and meta["capture"]["server_model"] == SERVED
    assert any(
        f"the vLLM server at {extraction.server.base_url} ({SERVED}, extract_hidden_states; layer ids {LAYERS} "
        f"read from the command line of pid {extraction.server.process.pid})" in line
        for line in pipeline.logs
    ), pipeline.logs
    assert sorted(extraction.folder.iterdir()) == [], "every request's file is deleted: the preflight's, the phase's"


def relative(found: Any, expected: Any) -> float:
    return float((found.float() - expected.float()).norm() / expected.float().norm())


def layers_of(store: Path) -> dict[str, dict[str, Any]]:
    """Per sample: its three aux layers and the teacher, [T, H] each, and its ids."""
    found = {}
    for sample in HiddenStateStore(store).iter_samples():
        aux = dict(zip([f"aux {k}" for k in AUX], sample.aux_hidden_states.chunk(3, dim=-1), strict=True))
        found[sample.sample_id] = {**aux, "teacher": sample.hidden_states, "input_ids": sample.input_ids}
    return found


LAYER_NAMES = [f"aux {k}" for k in AUX] + ["teacher"]


def largest_errors(
    found: dict[str, dict[str, Any]], expected: dict[str, dict[str, Any]], first: int
) -> dict[str, float]:
    """Per layer, the largest relative L2 error over the samples, each sample's positions from ``first`` on as
    one vector."""
    return {
        layer: max(relative(found[s][layer][first:], expected[s][layer][first:]) for s in found)
        for layer in LAYER_NAMES
    }


def nearest_other_layer(found: dict[str, dict[str, Any]], model: Path) -> dict[str, tuple[int, float]]:
    """Per layer of the store: the nearest other layer of the target (transformers, float32; for the teacher,
    the final norm applied to another layer's output) and its largest relative error over the samples from
    position 1 on: how far a state one layer off would be."""
    target = load_target(str(model), NAME, "cpu", "float32", False).model
    worst: dict[str, dict[int, float]] = {layer: {} for layer in LAYER_NAMES}
    for layers in found.values():
        with torch.inference_mode():
            outputs = target(input_ids=layers["input_ids"].long()[None], output_hidden_states=True).hidden_states
            # outputs[j + 1]: layer j's output for j < N - 1; the last one is after the final norm.
            normed = [target.model.norm(o[0]) for o in outputs[1:-1]]
        for other in range(len(outputs) - 2):
            candidates = {f"aux {k}": outputs[other + 1][0] for k in AUX if k != other}
            candidates["teacher"] = normed[other]
            for layer, state in candidates.items():
                error = relative(layers[layer][1:], state[1:])
                worst[layer][other] = max(worst[layer].get(other, 0.0), error)
    return {layer: min(errors.items(), key=lambda item: item[1]) for layer, errors in worst.items()}


def test_vllm_states_match_the_transformers_extractors_per_layer(
    pipeline: Materialized, local_model: Path, tmp_path: Path
) -> None:
    """The vLLM store against the transformers extractor's on the same rows. vLLM computes in bf16; the
    transformers extractor on the CPU in float32 is the reference; both stores hold bf16.

    How close is close enough, measured in the same run: the transformers extractor in bf16 against its own
    float32 run is what bf16 compute costs on this model. vLLM's bf16 kernels (another order of the sums, other
    batch shapes) may cost up to twice that, with a floor of 0.5 % (bf16's own rounding is 0.4 %) and a ceiling
    of 5 %, a quarter of what one layer off costs (≥ 20 % from position 1 on: asserted, printed).

    Where in the sample matters: position 0 (the attention sink) carries ~130× the norm of the others from the
    middle layers on, so over the whole sample it outweighs them, and adjacent layers differ by ~1 % there (their
    first-position states are almost the same). The bound is checked over the whole sample and from position 1
    on; the layer separation from position 1 on."""
    config = load_config(pipeline.config)
    layout = ArtifactLayout(config.artifacts_root)
    for dtype in ("float32", "bfloat16"):
        run(
            {
                "training_data": str(layout.training_data),
                "output": str(tmp_path / dtype),
                "model": str(local_model),
                "target_name": NAME,
                "device": "cpu",
                "dtype": dtype,
                "shard_tokens": 60,
                "spot_check_samples": 0,
                "max_batch_size": 1,
            },
            Recorder(),
        )
    vllm, reference, bf16 = (layers_of(p) for p in (layout.hidden_states, tmp_path / "float32", tmp_path / "bfloat16"))
    assert vllm.keys() == reference.keys() == bf16.keys() and len(vllm) == len(TEXTS + MORE_TEXTS)
    figures = {
        "vLLM, whole": largest_errors(vllm, reference, 0),
        "vLLM, pos >= 1": largest_errors(vllm, reference, 1),
        "tf bf16, whole": largest_errors(bf16, reference, 0),
        "tf bf16, pos >= 1": largest_errors(bf16, reference, 1),
    }
    nearest = nearest_other_layer(vllm, local_model)
    print(f"\n-- largest relative L2 error per layer over {len(vllm)} samples, against transformers float32")
    print(f"   {'layer':<9}" + "".join(f"{name:>19}" for name in figures) + f"{'nearest other layer':>26}")
    for layer in LAYER_NAMES:
        row = "".join(f"{column[layer]:>19.2%}" for column in figures.values())
        print(f"   {layer:<9}{row}{f'layer {nearest[layer][0]}: {nearest[layer][1]:.1%}':>26}")
    for where in ("whole", "pos >= 1"):
        for layer, error in figures[f"vLLM, {where}"].items():
            bound = min(max(2 * figures[f"tf bf16, {where}"][layer], 0.005), 0.05)
            assert error <= bound, (where, layer, error, bound)
    for layer, (other, error) in nearest.items():
        assert error >= 4 * 0.05, (layer, other, error)


def test_rows_of_another_tokenizer_are_refused_by_the_servers_own_tokenization(
    extraction: Extraction, local_model: Path, tmp_path: Path
) -> None:
    wrong = other_tokenizer(local_model, tmp_path / "other-tokenizer")
    data = rows_data(tmp_path / "training_data", wrong)
    status = record(data, extraction, str(tmp_path / "other-tokenizer"))
    assert "tokenization differs" in status, status
    with pytest.raises(ExtractionError) as caught:
        run(vllm_spec(data, tmp_path / "store", local_model, extraction), Recorder())
    message = str(caught.value)
    print(f"\n-- rows of another tokenizer: {message}")
    assert "training_data was tokenized by a tokenizer other than the served model's" in message
    assert f"vs {extraction.server.base_url}" in message and "from token " in message
    assert not list((tmp_path / "store").glob("shard-*")) and sorted(extraction.folder.iterdir()) == []


def test_a_server_with_other_layer_ids_is_refused_by_name_and_its_teacher_fails_the_validation(
    shifted: Extraction, local_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    data = rows_data(tmp_path / "training_data", AutoTokenizer.from_pretrained(local_model))
    with pytest.raises(VllmError) as refused:
        run(vllm_spec(data, tmp_path / "store", local_model, shifted), Recorder())
    message = str(refused.value)
    print(f"\n-- refusal: {message}")
    assert (
        f"the server (pid {shifted.server.process.pid}) was started with eagle_aux_hidden_state_layer_ids {SHIFTED}; "
        f"the store's aux layers {AUX} (output of layer) and teacher (layer 30) need "
        f"eagle_aux_hidden_state_layer_ids {LAYERS}: start the server with" in message
    )
    assert not (tmp_path / "store").exists()
    # The validation against the live target on its own (the ids not checked): its teacher is layer 28's output.
    assert record(data, shifted, str(local_model)).startswith(f"recorded from {shifted.server.base_url} (vllm)")
    settings = parse_spec(vllm_spec(data, tmp_path / "store", local_model, shifted))
    with open_vllm_target(str(local_model), NAME, shifted.server.base_url, str(shifted.folder), 4) as source:
        with pytest.raises(ExtractionError) as caught:
            validate_first(source, settings, TrainingData.open(data), AUX, Recorder())
    print(f"-- layer-shifted teacher: {caught.value}")
    assert "argmax(lm_head(teacher)) agrees with the serving target" in str(caught.value)
    assert "below hidden_states.validation.min_agreement 90%" in str(caught.value)
    assert sorted(shifted.folder.iterdir()) == []


def test_a_finished_phase_reruns_with_the_extraction_server_stopped(
    pipeline: Materialized, extraction: Extraction
) -> None:
    """The user's report: after a complete run, the rerun with the server stopped failed at GET /models. Last in
    the module: it stops the server."""
    stop_group(extraction.server.process)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{extraction.server.base_url}/models", timeout=5)
    again = materialize(pipeline.config)
    meta, first = again.meta, pipeline.meta
    print(f"\n-- rerun, server stopped: {[line for line in again.logs if 'extract:' in line or 'serving' in line]}")
    print(f"-- its checks: {again.checks}")
    assert meta["serving_reference_status"] == "not needed: the store is complete for these settings"
    assert meta["shards_written"] == 0 and meta["shards_reused"] == first["shards"]
    assert {k: meta[k] for k in ("serving_agreement", "spot_check_max_rel_error", "bytes", "capture")} == {
        k: first[k] for k in ("serving_agreement", "spot_check_max_rel_error", "bytes", "capture")
    }
    assert all(
        passed and "as recorded when the store was completed" in text
        for passed, text in [again.checks["spot_check"], again.checks["serving_agreement"]]
    )
