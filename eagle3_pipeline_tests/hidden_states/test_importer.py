"""The SpecForge importer against fixture files in SpecForge's documented format, written here with
``torch.save``: byte-identical shards to what our own ShardWriter (the extractor's) writes for the
same samples, resume after a torn shard, and clear errors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from eagle3_pipeline.hidden_states.importer import SpecForgeImportError, run
from eagle3_pipeline.hidden_states.store import HiddenStateStore, ShardWriter, StoreError
from eagle3_pipeline.testing.reporter import Recorder
from eagle3_pipeline.testing.stores import shard_contents
from eagle3_pipeline_tests.hidden_states.specforge_files import (
    import_spec,
    make_samples,
    write_specforge,
    write_training_data,
)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name.startswith("shard-")}


def test_imported_shards_are_byte_identical_to_our_writer(tmp_path: Path) -> None:
    samples = make_samples(10)
    sf = write_specforge(tmp_path / "sf", samples[:5])
    write_specforge(tmp_path / "sf", samples[5:], compress=True)
    training = write_training_data(tmp_path / "training_data", samples)
    report = Recorder()
    metadata = run(import_spec(sf, tmp_path / "store", training, per_shard=4), report)

    ours = tmp_path / "ours"
    for number in range(3):
        writer = ShardWriter(ours, number)
        for s in samples[number * 4 : number * 4 + 4]:
            writer.add(
                s.sample_id,
                s.dataset,
                split=s.split,
                input_ids=s.input_ids,
                loss_mask=s.loss_mask,
                aux=s.aux,
                hidden=s.hidden,
            )
        writer.close()

    imported = files_of(tmp_path / "store")
    assert (
        sorted(imported)
        == sorted(files_of(ours))
        == [f"shard-0000{i}.{ext}" for i in range(3) for ext in ("index.parquet", "safetensors")]
    )
    assert shard_contents(tmp_path / "store") == shard_contents(ours), "tensors or index differ from ShardWriter's"
    store = HiddenStateStore(tmp_path / "store")
    for s, read in zip(samples, store.iter_samples(), strict=True):
        assert read.sample_id == s.sample_id and read.split == s.split and read.dataset == s.dataset
        assert read.aux_hidden_states.dtype == torch.bfloat16
        assert torch.equal(read.aux_hidden_states, s.aux.to(torch.bfloat16))
        assert torch.equal(read.hidden_states, s.hidden.to(torch.bfloat16))
        assert torch.equal(read.input_ids, s.input_ids)
    manifest = store.manifest()
    assert manifest.samples == 10 and manifest.tokens == sum(len(s.input_ids) for s in samples)
    assert manifest.aux_layer_ids == [1, 3, 4] and manifest.layer_convention == "output_of_layer"
    assert metadata["samples"] == 10 and metadata["shards"] == 3 and metadata["samples_without_states"] == 0
    assert metadata["loss_mask_disagreements"] == 0
    assert [p["shards_done"] for p in report.points] == [1, 2, 3]


def test_gaps_resume_and_our_loss_mask_wins(tmp_path: Path) -> None:
    samples = make_samples(9, seed=1)
    kept = [s for s in samples if s.idx != 4]  # SpecForge skips records with NaN
    sf_samples = [replace(kept[0], loss_mask=torch.ones_like(kept[0].loss_mask)), *kept[1:]]
    sf = write_specforge(tmp_path / "sf", sf_samples)
    training = write_training_data(tmp_path / "td", samples)
    first = run(import_spec(sf, tmp_path / "store", training, per_shard=3), Recorder())
    assert first["samples"] == 8 and first["samples_without_states"] == 1 and first["loss_mask_disagreements"] == 1
    read = next(HiddenStateStore(tmp_path / "store").iter_samples())
    assert torch.equal(read.loss_mask, samples[0].loss_mask.bool())
    before = shard_contents(tmp_path / "store")
    (tmp_path / "store" / "shard-00001.index.parquet").unlink()  # a shard torn by a kill
    second = run(import_spec(sf, tmp_path / "store", training, per_shard=3), Recorder())
    assert second["shards_skipped"] == 2
    assert shard_contents(tmp_path / "store") == before


def test_errors_name_the_file_and_what_was_expected(tmp_path: Path) -> None:
    samples = make_samples(3, seed=2)
    sf = write_specforge(tmp_path / "sf", samples)
    other = make_samples(3, seed=3)
    training = write_training_data(tmp_path / "td", other)
    with pytest.raises(SpecForgeImportError, match=r"data_0\.ckpt: input_ids differ from training_data row 0"):
        run(import_spec(sf, tmp_path / "a", training), Recorder())

    run(import_spec(sf, tmp_path / "b", None), Recorder())
    spec = import_spec(sf, tmp_path / "b", None)
    spec["aux_layer_ids"] = [2, 3, 4]
    with pytest.raises(StoreError, match="aux_layer_ids: store has"):
        run(spec, Recorder())

    bad = samples[0]
    bad.hidden[2, 1] = float("nan")
    write_specforge(tmp_path / "nan", [bad])
    with pytest.raises(SpecForgeImportError, match=r"data_0\.ckpt: sample specforge-0: hidden_states holds NaN"):
        run(import_spec(tmp_path / "nan", tmp_path / "c", None), Recorder())

    (tmp_path / "junk" / "rows_0-2000").mkdir(parents=True)
    (tmp_path / "junk" / "rows_0-2000" / "data_0.ckpt").write_text("not a tensor file")
    with pytest.raises(SpecForgeImportError, match="data_0.ckpt: not a readable torch.save file"):
        run(import_spec(tmp_path / "junk", tmp_path / "d", None), Recorder())
    with pytest.raises(SpecForgeImportError, match="missing key 'target'"):
        run({"input_dir": str(sf), "output_dir": str(tmp_path / "e")}, Recorder())


def test_an_fp8_import_writes_what_our_fp8_writer_writes(tmp_path: Path) -> None:
    samples = make_samples(6, seed=4)
    sf = write_specforge(tmp_path / "sf", samples)
    training = write_training_data(tmp_path / "td", samples)
    spec = {**import_spec(sf, tmp_path / "store", training, per_shard=3), "storage_dtype": "float8_e4m3"}
    metadata = run(spec, Recorder())
    ours = tmp_path / "ours"
    for number in range(2):
        writer = ShardWriter(ours, number, "float8_e4m3")
        for s in samples[number * 3 : number * 3 + 3]:
            writer.add(
                s.sample_id,
                s.dataset,
                split=s.split,
                input_ids=s.input_ids,
                loss_mask=s.loss_mask,
                aux=s.aux,
                hidden=s.hidden,
            )
        writer.close()
    assert shard_contents(tmp_path / "store") == shard_contents(ours), "tensors or index differ from ShardWriter's"
    assert (
        HiddenStateStore(tmp_path / "store").manifest().dtype == "float8_e4m3"
        and metadata["storage_dtype"] == "float8_e4m3"
    )
    assert metadata["bytes_per_token_formula"] == 4 * (8 + 4) + 5
    with pytest.raises(StoreError, match="dtype: store has 'float8_e4m3', expected 'bfloat16'"):
        run(import_spec(sf, tmp_path / "store", training, per_shard=3), Recorder())
    with pytest.raises(
        SpecForgeImportError, match=r"spec.storage_dtype: expected one of bfloat16, float8_e4m3, got 'int8'"
    ):
        run({**spec, "storage_dtype": "int8"}, Recorder())
