"""The resource model against engine start-up logs someone else published (data/anchors/README.md cites each:
repository and issue, the lines as printed): weights per GPU within 5 %, KV bytes per token and KV tokens
within 10 %. Configs under data/anchors/<model>/ are the published config.json fields (partial copies marked
``_source``); no checkpoint index was found for these models, so weights come from the config (basis config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.fit.checkpoint import read_config_json, read_weights
from eagle3_pipeline.fit.engines import kv_per_token, serving_fit

GIB = 1 << 30
DATA = Path(__file__).parent / "data" / "anchors"
ANCHORS = [
    a for a in json.loads((DATA / "anchors.json").read_text()) if (DATA / a["model_key"] / "config.json").is_file()
]


def test_enough_anchors_with_a_config() -> None:
    assert len(ANCHORS) >= 8


@pytest.mark.parametrize("anchor", ANCHORS, ids=[a["id"] for a in ANCHORS])
def test_prediction_matches_the_published_log(anchor: dict) -> None:
    folder = DATA / anchor["model_key"]
    raw = read_config_json(folder)
    weights = read_weights(folder, raw)
    logged = anchor["logged"]
    per_token = kv_per_token(raw, anchor["tp"], "auto")
    checked = 0
    if logged["weights_gib"] is not None:
        predicted = weights.per_gpu_bytes(anchor["tp"]) / GIB
        print(f"{anchor['id']}: weights {predicted:.2f} GiB vs {logged['weights_gib']} logged")
        assert abs(predicted / logged["weights_gib"] - 1) <= 0.05
        checked += 1
    if logged["kv_tokens"] and logged["kv_size_gib"]:
        measured = logged["kv_size_gib"] * GIB / logged["kv_tokens"]
        assert abs(per_token / measured - 1) <= 0.10, (per_token, measured)
        checked += 1
    if logged["kv_tokens"] and logged["available_kv_gib"]:
        predicted_tokens = logged["available_kv_gib"] * GIB / per_token
        print(f"{anchor['id']}: KV tokens {predicted_tokens:,.0f} vs {logged['kv_tokens']:,} logged")
        assert abs(predicted_tokens / logged["kv_tokens"] - 1) <= 0.10
        checked += 1
    if (
        anchor["engine"] == "sglang"
        and logged["kv_tokens"]
        and logged["avail_after_load_gib"]
        and logged["weights_gib"]
    ):
        # SGLang's budget rule with the log's own weights and free memory: pool = before × fraction − weights.
        fraction = anchor["mem_fraction"] or 0.88
        before = (logged["avail_after_load_gib"] + logged["weights_gib"]) * GIB
        fit = serving_fit(
            "sglang", weights, raw, tp=anchor["tp"], gpu_bytes=int(before), fraction=fraction,
            weights_per_gpu=logged["weights_gib"] * GIB, free_before_load=before,
        )  # fmt: skip
        print(f"{anchor['id']}: SGLang pool {fit.kv_tokens:,} tokens vs {logged['kv_tokens']:,} logged")
        assert abs(fit.kv_tokens / logged["kv_tokens"] - 1) <= 0.10
        checked += 1
    assert checked, "an anchor with nothing to compare"
