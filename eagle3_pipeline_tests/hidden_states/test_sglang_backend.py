"""``hidden_states.backend: sglang`` run against the stand-ins for SGLang's CUDA runtime, one per
release the worker supports (``sglang_standin/0.5.14`` and ``sglang_standin/0.5.23`` over the shared
``sglang_standin/core``: this machine has no GPU and no sglang; each stand-in implements exactly its
release's uses with transformers on the CPU and SGLang's capture semantics).

The worker's store must be byte-identical to the transformers extractor's for the same samples, on
both releases' code paths: the extractor runs with batch size 1 (each sample alone), the worker with
packed batches of up to four requests, whose rows it must split back, in order, at the right layers
(from a list of per-layer states on 0.5.14, from one packed tensor for DeepSeek/Kimi on 0.5.23). The
stand-ins compute each request of a batch alone, as the extractor does, so any difference is the
worker's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.hidden_states.extract import batches, run
from eagle3_pipeline.hidden_states.sglang_api import RELEASES, SUPPORTED_VERSIONS, SGLangApi, SGLangError
from eagle3_pipeline.hidden_states.sharding import assign_shards
from eagle3_pipeline.hidden_states.store import HiddenStateStore
from eagle3_pipeline.target.layer_ids import LayerIdError
from eagle3_pipeline.testing.extract_specs import extract_spec, transformers_spec
from eagle3_pipeline.testing.kimi.fixture import VOCAB_SIZE as KIMI_VOCAB
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.stores import assert_same_store
from eagle3_pipeline.testing.training_data import two_dataset_training_data
from eagle3_pipeline.training_data.reader import TrainingData, iter_rows
from eagle3_pipeline_tests.hidden_states.sglang_source import SourceTree, check_release
from eagle3_pipeline_tests.hidden_states.sglang_standins import active_standin, standin_path

pytestmark = pytest.mark.slow


@pytest.fixture(params=SUPPORTED_VERSIONS)
def standin(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each release's stand-in, in turn, for this test only."""
    with active_standin(request.param):
        yield request.param


def sglang_spec(data: Path, output: Path, model: Path, name: str, **settings: Any) -> dict[str, Any]:
    """Packed batches of up to 4 requests (64 padded tokens), one process; the memory share a number, as the
    pipeline writes it once the resource model has chosen (a spec carries no auto)."""
    return extract_spec(
        data,
        output,
        model,
        name,
        **{
            "backend": "sglang",
            "sglang_python": sys.executable,
            "tp_size": 1,
            "batch_tokens": 64,
            "max_batch_size": 4,
            "mem_fraction_static": 0.75,
            **settings,
        },
    )


def lengths(data: Path, shard: Any) -> Iterator[int]:
    rows = iter_rows(data / shard.source, ["num_tokens"], shard.start)
    for _ in shard.sample_ids:
        yield next(rows)["num_tokens"]


def extract_both_releases(
    data: Path, folder: Path, model: Path, name: str, **settings: Any
) -> dict[str, dict[str, Any]]:
    """The worker on each release's stand-in, one after the other, into ``folder/<version>``."""
    results = {}
    for version in SUPPORTED_VERSIONS:
        with active_standin(version):
            results[version] = run(sglang_spec(data, folder / version, model, name, **settings), Recorder())
    return results


@pytest.mark.local_model
def test_both_releases_write_the_transformers_extractors_bytes(tmp_path: Path, local_model: Path) -> None:
    data = two_dataset_training_data(tmp_path / "training_data", 49152)
    name = "SmolLM2-135M-Instruct"
    theirs = run(transformers_spec(data, tmp_path / "transformers", local_model, name), Recorder())
    results = extract_both_releases(data, tmp_path / "sglang", local_model, name)
    packed = [
        len(group)
        for shard in assign_shards(TrainingData.open(data), 40)
        for group in batches(list(lengths(data, shard)), 64, 4)
    ]
    print(f"\n-- requests per SGLang forward: {packed}")
    assert max(packed) > 1
    for version, ours in results.items():
        figures = assert_same_store(tmp_path / "sglang" / version, tmp_path / "transformers")
        print(
            f"-- sglang {version}: byte-identical store (SmolLM2, Llama family): {figures}, {ours['samples']} samples, "
            f"{ours['tokens']} tokens, {ours['shards']} shards; aux {ours['aux_layer_ids']}"
        )
        print("   capture record:", ours["capture"])
        assert ours["samples"] == theirs["samples"] == 10 and ours["shards"] > 1
        assert ours["capture"] == {
            "backend": "sglang",
            "sglang_version": version,
            "tp_size": 1,
            "device": "cpu",
            "dtype": "auto",
            "model_class": "LlamaForCausalLM",
            "family": "llama",
            "family_rule": "id + 1 for every id",
            "set_eagle3_layers_to_capture": [1, 14, 26],
            "layers_to_capture": [2, 15, 27],
            "aux_form": "list",
        }
        assert HiddenStateStore(tmp_path / "sglang" / version).manifest().capture == ours["capture"]
        assert ours["spot_check_passed"] and ours["spot_check_max_rel_error"] == 0.0
        assert ours["spot_check_samples"] == 2
        assert ours["spot_check_method"] == "alone (one request per forward) through the same SGLang runner"
    first, second = (tmp_path / "sglang" / v for v in SUPPORTED_VERSIONS)
    print(f"-- sglang {' vs '.join(SUPPORTED_VERSIONS)}: {assert_same_store(second, first)}")


def test_a_kimi_target_gets_deepseeks_layer_rule_on_both_releases(
    tmp_path: Path,
    kimi_checkpoint: Path,
) -> None:
    """SGLang's DeepSeek-V3 (which Kimi-K2.5 wraps) adds 1 to the ids when the first is 1: the ids
    handed to set_eagle3_layers_to_capture follow layer_ids.server_layer_ids, and the states are the
    outputs of the trained layers (the transformers extractor's bytes), handed over as a list on
    0.5.14 and as one packed tensor on 0.5.23."""
    data = two_dataset_training_data(tmp_path / "training_data", KIMI_VOCAB)
    settings = {"aux_layer_ids": [1, 3, 4], "trust_remote_code": True}
    run(transformers_spec(data, tmp_path / "transformers", kimi_checkpoint, "Kimi-K2.5", **settings), Recorder())
    results = extract_both_releases(data, tmp_path / "sglang", kimi_checkpoint, "Kimi-K2.5", **settings)
    for version, ours in results.items():
        figures = assert_same_store(tmp_path / "sglang" / version, tmp_path / "transformers")
        record = ours["capture"]
        print(f"\n-- sglang {version}: byte-identical store (tiny Kimi-K2.5, aux form {record['aux_form']}): {figures}")
        assert record["model_class"] == "KimiK25ForConditionalGeneration" and record["family"] == "deepseek"
        assert record["set_eagle3_layers_to_capture"] == [1, 3, 4] and record["layers_to_capture"] == [2, 4, 5]
        assert record["aux_form"] == {"0.5.14": "list", "0.5.23": "packed"}[version]
    first, second = (tmp_path / "sglang" / v for v in SUPPORTED_VERSIONS)
    print(f"-- sglang {' vs '.join(SUPPORTED_VERSIONS)}: {assert_same_store(second, first)}")


def test_a_kimi_target_refuses_a_first_id_other_than_1_before_extracting(
    standin: str,
    tmp_path: Path,
    kimi_checkpoint: Path,
) -> None:
    data = two_dataset_training_data(tmp_path / "training_data", KIMI_VOCAB)
    settings = {"aux_layer_ids": [2, 3, 4], "trust_remote_code": True}
    with pytest.raises(LayerIdError, match=r"aux layer ids \[2, 3, 4\]: a DeepSeek-family target"):
        run(sglang_spec(data, tmp_path / "sglang", kimi_checkpoint, "Kimi-K2.5", **settings), Recorder())
    assert not list((tmp_path / "sglang").glob("shard-*"))


def test_aux_states_in_another_form_than_the_releases_are_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kimi_checkpoint: Path,
) -> None:
    """0.5.23's DeepSeek decoder hands one packed tensor: a release table that said "list" would
    mis-split it, so the worker refuses instead."""
    release = RELEASES["0.5.23"]
    wrong = tuple(replace(entry, form="list") if entry.decoder == "DeepseekV2Model" else entry for entry in release.aux)
    monkeypatch.setattr(type(release), "aux", wrong)
    data = two_dataset_training_data(tmp_path / "training_data", KIMI_VOCAB)
    settings = {"aux_layer_ids": [1, 3, 4], "trust_remote_code": True}
    with (
        active_standin("0.5.23"),
        pytest.raises(
            SGLangError,
            match=r"SGLang 0\.5\.23 DeepseekV2Model handed its LogitsProcessor aux states \(\d+, 192\); its AuxForm "
            r"is a list of 3 \[N, 64\] tensors",
        ),
    ):
        run(sglang_spec(data, tmp_path / "sglang", kimi_checkpoint, "Kimi-K2.5", **settings), Recorder())


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_each_standin_implements_exactly_its_releases_names(version: str) -> None:
    """Each stand-in is read with the same source checker as its release's wheel."""

    def read(path: str) -> str | None:
        for root in standin_path(version):
            if (root / path).is_file():
                return (root / path).read_text()
        return None

    assert check_release(SourceTree(read), RELEASES[version]) == []


def test_another_sglang_version_a_name_not_listed_and_a_wrong_launch_are_refused(
    standin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = SGLangApi()
    assert api.release.version == standin
    with pytest.raises(
        SGLangError,
        match=r"ServerArgs: called with 0 positional argument\(s\) and keyword\(s\) \['model_path', 'port'\]",
    ):
        api.new("ServerArgs", model_path="m", port=30000)
    with pytest.raises(SGLangError, match=rf"Scheduler: not an SGLang class of the uses of sglang {standin}"):
        api.new("Scheduler")
    with pytest.raises(SGLangError, match=r"ScheduleBatch: its use lists no keywords: referenced, not constructed"):
        api.new("ScheduleBatch")
    other = {"0.5.14": "ChunkCache", "0.5.23": "UnifiedRadixCache"}
    [foreign] = [name for version, name in other.items() if version != standin]
    with pytest.raises(SGLangError, match=rf"{foreign}: not an SGLang class of the uses of sglang {standin}"):
        api.cls(foreign)
    import sglang.version  # pyright: ignore[reportMissingImports]  # the stand-in's, on sys.path by the fixture

    monkeypatch.setattr(sglang.version, "__version__", "0.5.22")
    with pytest.raises(
        SGLangError,
        match=(
            r"hidden_states.sglang_python: this python has sglang 0.5.22; the worker is "
            r"written against sglang 0.5.14 and 0.5.23"
        ),
    ):
        SGLangApi()
    monkeypatch.setattr(sglang.version, "__version__", standin)
    data = two_dataset_training_data(tmp_path / "training_data", 49152)
    with pytest.raises(SGLangError, match=r"hidden_states.tp_size is 2 but this launch has 1 process\(es\)"):
        run(sglang_spec(data, tmp_path / "store", tmp_path, "x", tp_size=2), Recorder())


def test_without_sglang_the_error_names_the_python_setting(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("an sglang package is importable here")
    with pytest.raises(
        SGLangError, match=r"hidden_states.sglang_python: cannot import sglang here .*sglang 0.5.14 or 0.5.23"
    ):
        SGLangApi()
