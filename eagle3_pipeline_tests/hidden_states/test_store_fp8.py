"""The fp8 store (``hidden_states.storage_dtype: float8_e4m3``): what the writer stores, what every
reader hands back (within e4m3's rounding), the bytes it costs against the formula, and the
dtype as part of the store's identity. Real files, random states (no model needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch

from eagle3_pipeline.drafter.evaluate.phase import read_rows
from eagle3_pipeline.drafter.train.data import BatchReader, Row
from eagle3_pipeline.hidden_states.spot_check import stored_slice
from eagle3_pipeline.hidden_states.store import (
    AUX_KEY,
    AUX_SCALE_KEY,
    BF16,
    FP8,
    HIDDEN_KEY,
    HIDDEN_SCALE_KEY,
    IDS_KEY,
    MASK_KEY,
    HiddenStateStore,
    ShardFile,
    ShardWriter,
    StoreError,
    StoreManifest,
    TargetIdentity,
    bytes_per_token,
    bytes_per_token_check,
    identity_mismatch,
)

H = 64
# e4m3 keeps 3 mantissa bits: a value x/scale in the normal range is rounded to within 2⁻⁴ of itself;
# below e4m3's smallest normal (2⁻⁶) its step is 2⁻⁹, so the error there is at most scale·2⁻¹⁰.
# Dequantizing to bf16 adds at most 2⁻⁹ of the value.
ELEMENT_RELATIVE = 2**-4 + 2**-8


def _states(length: int, seed: int, layers: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(length, layers * H, generator=g) * torch.logspace(-2, 2, length)[:, None]


def _write(root: Path, dtype: str, samples: dict[str, tuple]) -> HiddenStateStore:
    writer = ShardWriter(root, 0, dtype)
    for sid, (ids, mask, aux, hidden) in samples.items():
        writer.add(sid, "B1", split="train", input_ids=ids, loss_mask=mask, aux=aux, hidden=hidden)
    size = writer.close()
    store = HiddenStateStore(root)
    index = store.write_index(["shard-00000"])
    target = TargetIdentity("tiny", "abc", 8, H, 100)
    store.write_manifest(
        StoreManifest(
            target,
            [1, 3, 4],
            "v1",
            dtype=dtype,
            shards=["shard-00000"],
            samples=index.num_rows,
            tokens=writer.tokens,
            bytes=size,
        )
    )
    return store


def _samples(count: int = 3) -> dict[str, tuple]:
    out = {}
    for i in range(count):
        n = 7 + 3 * i
        ids = torch.arange(n) + 10 * i
        mask = (torch.arange(n) >= 2).to(torch.uint8)
        out[f"s{i}"] = (ids, mask, _states(n, i, 3), _states(n, 100 + i, 1))
    return out


def _within_fp8(found: torch.Tensor, original: torch.Tensor, layers: int) -> None:
    """Every element within e4m3's rounding of the bf16 original, scale per token and layer."""
    assert found.dtype == torch.bfloat16 and found.shape == original.shape
    expected = original.to(torch.bfloat16).float().reshape(original.shape[0], layers, -1)
    scale = expected.abs().amax(-1, keepdim=True) / 448
    error = (found.float().reshape(expected.shape) - expected).abs()
    assert bool((error <= ELEMENT_RELATIVE * expected.abs() + scale * 2**-10 + 1e-30).all()), float(
        (error - ELEMENT_RELATIVE * expected.abs()).max()
    )


def test_every_reader_hands_back_the_fp8_states_dequantized(tmp_path: Path) -> None:
    samples = _samples()
    store = _write(tmp_path, FP8, samples)
    shard = ShardFile(tmp_path / "shard-00000.safetensors")
    assert shard.dtype == FP8
    from safetensors import safe_open

    with safe_open(str(tmp_path / "shard-00000.safetensors"), framework="pt") as handle:
        raw = {key: handle.get_slice(key).get_dtype() for key in handle.keys()}
    assert raw == {
        AUX_KEY: "F8_E4M3",
        HIDDEN_KEY: "F8_E4M3",
        AUX_SCALE_KEY: "F32",
        HIDDEN_SCALE_KEY: "F32",
        IDS_KEY: "I32",
        MASK_KEY: "U8",
    }

    for sample in store.iter_samples():  # HiddenStateStore.iter_samples
        ids, mask, aux, hidden = samples[sample.sample_id]
        assert torch.equal(sample.input_ids, ids) and torch.equal(sample.loss_mask, mask.bool())
        _within_fp8(sample.aux_hidden_states, aux, 3)
        _within_fp8(sample.hidden_states, hidden, 1)

    rows = store.index().to_pylist()
    for row, tensors in read_rows(store, rows, (IDS_KEY, MASK_KEY, AUX_KEY, HIDDEN_KEY)):  # drafter_eval
        _ids, _mask, aux, hidden = samples[row["sample_id"]]
        _within_fp8(tensors[AUX_KEY], aux, 3)
        _within_fp8(tensors[HIDDEN_KEY], hidden, 1)
        _within_fp8(stored_slice(store, row, HIDDEN_KEY), hidden, 1)  # the extract phase's spot check

    batch = BatchReader(tmp_path, max_seq_len=64).read(
        [Row(r["shard"], r["offset"], r["length"]) for r in rows]
    )  # training
    for i, row in enumerate(rows):
        _ids, _mask, aux, hidden = samples[row["sample_id"]]
        n = row["length"]
        _within_fp8(batch.aux[i, :n], aux, 3)
        _within_fp8(batch.hidden[i, :n], hidden, 1)
        assert batch.aux.dtype == torch.bfloat16 and not batch.attention_mask[i, n:].any()


def test_per_token_scales_keep_an_outlier_token_from_flattening_the_others(tmp_path: Path) -> None:
    n = 6
    aux, hidden = torch.randn(n, 3 * H), torch.randn(n, H)
    aux[2] *= 1e4
    hidden[2] *= 1e4
    store = _write(tmp_path, FP8, {"s": (torch.arange(n), torch.ones(n, dtype=torch.uint8), aux, hidden)})
    (sample,) = store.iter_samples()
    for found, original in ((sample.aux_hidden_states, aux), (sample.hidden_states, hidden)):
        quiet = torch.arange(n) != 2
        relative = (found[quiet].float() - original[quiet]).norm() / original[quiet].norm()
        assert relative < 0.05, relative  # one scale for all tokens would round these to zero


def test_bf16_stores_are_unchanged_and_fp8_is_not_read_as_bf16(tmp_path: Path) -> None:
    samples = _samples(2)
    bf16 = _write(tmp_path / "bf16", BF16, samples)
    assert ShardFile(bf16.root / "shard-00000.safetensors").dtype == BF16
    for sample in bf16.iter_samples():
        assert torch.equal(sample.aux_hidden_states, samples[sample.sample_id][2].to(torch.bfloat16))
    with pytest.raises(StoreError, match=r"shard-00000.safetensors: no tensor 'aux_scales'"):
        ShardFile(bf16.root / "shard-00000.safetensors").read(AUX_SCALE_KEY, 0, 1)
    with pytest.raises(StoreError, match=r"storage dtype 'float16': expected one of bfloat16, float8_e4m3"):
        ShardWriter(tmp_path, 0, "float16")


def test_a_bf16_and_an_fp8_store_never_share_an_identity(tmp_path: Path) -> None:
    samples = _samples(1)
    found = _write(tmp_path / "a", BF16, samples).manifest()
    wanted = _write(tmp_path / "b", FP8, samples).manifest()
    assert identity_mismatch(found, wanted) == ["dtype: store has 'bfloat16', expected 'float8_e4m3'"]
    assert identity_mismatch(wanted, found) == ["dtype: store has 'float8_e4m3', expected 'bfloat16'"]


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_bytes_per_token_formula_matches_a_real_store_within_one_percent(tmp_path: Path, dtype: str) -> None:
    hidden_size, n = 576, 2000  # the embedded model's width, enough tokens that the header is noise
    g = torch.Generator().manual_seed(0)
    writer = ShardWriter(tmp_path, 0, dtype)
    for i in range(4):
        writer.add(
            f"s{i}",
            "B1",
            split="train",
            input_ids=torch.arange(n // 4),
            loss_mask=torch.ones(n // 4, dtype=torch.uint8),
            aux=torch.randn(n // 4, 3 * hidden_size, generator=g),
            hidden=torch.randn(n // 4, hidden_size, generator=g),
        )
    measured = writer.close() / n
    formula = bytes_per_token(hidden_size, 3, dtype)
    assert abs(measured / formula - 1) < 0.01, (measured, formula)
    assert formula == {BF16: 4 * 576 * 2 + 5, FP8: 4 * (576 + 4) + 5}[dtype]
    assert bytes_per_token_check(measured, hidden_size, 3, dtype, 0.05)[0]
    other = FP8 if dtype == BF16 else BF16
    passed, text = bytes_per_token_check(measured, hidden_size, 3, other, 0.05)
    assert not passed and f"formula for {other}" in text and "another storage dtype" in text


def test_kimi_bytes_per_token_per_dtype() -> None:
    assert bytes_per_token(7168, 3, BF16) == 57_349
    assert bytes_per_token(7168, 3, FP8) == 28_693
    with pytest.raises(StoreError, match="storage dtype 'int8'"):
        bytes_per_token(7168, 3, "int8")
