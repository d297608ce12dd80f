"""The `extract` phase's spot check: a fixed sample of the stored states computed again, one
sequence alone, and compared with the store."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from eagle3_pipeline.hidden_states.capture import SampleError
from eagle3_pipeline.hidden_states.extract_spec import ExtractionError
from eagle3_pipeline.hidden_states.sources import StateSource
from eagle3_pipeline.hidden_states.store import (
    AUX_KEY,
    BF16,
    HIDDEN_KEY,
    IDS_KEY,
    HiddenStateStore,
    ShardFile,
    as_stored,
)

# The spot check's tolerance when hidden_states.spot_check_tolerance is null, per backend (its description says why).
SPOT_CHECK_TOLERANCE = {"transformers": 0.01, "sglang": 0.01, "vllm": 0.1}


def _relative_error(found: Any, expected: Any) -> float:
    diff = (found.float() - expected.float()).norm()
    scale = expected.float().norm()
    return float(diff / scale) if float(scale) > 0 else float(diff)


def spot_check_ids(index_ids: Sequence[str], count: int) -> list[str]:
    """A fixed sample of the store's ids: the ``count`` with the smallest SHA-256."""
    return sorted(index_ids, key=lambda i: hashlib.sha256(i.encode()).hexdigest())[:count]


def stored_slice(store: HiddenStateStore, row: dict[str, Any], key: str) -> Any:
    """One sample's stored tensor (states dequantized to bf16 from an fp8 store)."""
    return ShardFile(store.root / f"{row['shard']}.safetensors").read(key, row["offset"], row["offset"] + row["length"])


def spot_check(
    store: HiddenStateStore,
    source: StateSource,
    aux_ids: Sequence[int],
    count: int,
    tolerance: float,
    dtype: str = BF16,
) -> dict[str, Any]:
    """Re-compute ``count`` stored samples alone through the source's ``reference_states`` (every
    rank: the writer shares which); the writer compares them with the store in bf16, the fresh
    states rounded as the store's ``dtype`` rounds them (fp8's own rounding is the storage's cost,
    measured by benchmarks/store_dtype_tau.py; what the check looks for is states that belong to
    another token, layer or sample)."""
    chosen: list[dict[str, Any]] = []
    if source.writer:
        rows = store.index().to_pylist()
        picked = set(spot_check_ids([r["sample_id"] for r in rows], count))
        chosen = [
            {**row, "input_ids": stored_slice(store, row, IDS_KEY).tolist()}
            for row in rows
            if row["sample_id"] in picked
        ]
    chosen = source.share(chosen)
    worst, worst_id = 0.0, ""
    for row in chosen:
        try:
            aux, hidden = source.reference_states(aux_ids, row["input_ids"])
        except SampleError as exc:
            raise ExtractionError(f"spot check, sample {row['sample_id']!r}: {exc.message}") from None
        if not source.writer:
            continue
        for key, fresh, layers in ((AUX_KEY, aux, len(aux_ids)), (HIDDEN_KEY, hidden, 1)):
            error = _relative_error(stored_slice(store, row, key), as_stored(fresh.to("cpu"), layers, dtype))
            if error > worst:
                worst, worst_id = error, row["sample_id"]
    return {
        "spot_check_samples": len(chosen),
        "spot_check_method": source.spot_check_method,
        "spot_check_max_rel_error": worst,
        "spot_check_worst_sample": worst_id,
        "spot_check_tolerance": tolerance,
        "spot_check_passed": worst <= tolerance,
    }
