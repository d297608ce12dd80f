"""A finished phase needs no server: after `responses` and `training_data` ran against a server, the
server is stopped (its port refuses) and both rerun as no-ops, on a real Dagster instance. Old output
is not new output: training_data reuses its store only for the same identity, and runs again (asking
the server, which is down) when the settings changed.

The server is the scripted OpenAI-compatible one on loopback, its `/tokenize` the tiny real model's
tokenizer (so the tokenizer agreement is "ok"); it records no serving reference, so
hidden_states.validation is off here (with it on and no reference recorded, training_data has
something left to do and asks again — see the last step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import pytest

from eagle3_pipeline.components.pipeline import build_definitions
from eagle3_pipeline.config import PipelineConfig, load_config
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.fake_openai import FakeOpenAI

pytestmark = [pytest.mark.local_model]


def pipeline(folder: Path, base_url: str, model: Path, seed: int = 0, validation: int = 0) -> PipelineConfig:
    write_jsonl(folder / "p.jsonl", [sharegpt(f"Say the number {i}.") for i in range(6)])
    (folder / "pipeline.yaml").write_text(
        json.dumps(
            {
                "name": "rerun",
                "artifacts_root": "out",
                "seed": seed,
                "target": {"model": "fake", "tokenizer": str(model)},
                "inference": {"kind": "endpoints", "endpoints": [{"base_url": base_url}]},
                "generation": {"max_tokens": 8, "concurrency": 2},
                "health": {"max_truncation_rate": 1.0, "min_disk_free_gb": 0.01, "min_mem_free_gb": 0.01},
                "training_data": {"tokenizer_check_samples": 4},
                "hidden_states": {"validation": {"samples": validation}},
                "datasets": [{"id": "B1", "source": "p.jsonl"}],
            }
        )
    )
    return load_config(folder / "pipeline.yaml")


def materialize(
    config: PipelineConfig, instance: dg.DagsterInstance, asset: str, partition: str | None = None
) -> dict[str, Any]:
    defs = build_definitions(config)
    assets: Any = list(defs.assets or [])
    selection = ["prompts", "responses"] if asset == "responses" else [asset]
    result = dg.materialize(
        assets, selection=selection, partition_key=partition, instance=instance, resources=defs.resources
    )
    [materialization] = result.asset_materializations_for_node(asset)
    return {key: value.value for key, value in materialization.metadata.items()}


def test_finished_responses_and_training_data_rerun_with_the_server_down(tmp_path: Path, local_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(local_model))
    server = FakeOpenAI(tokenize=lambda text: list(tokenizer.encode(text, add_special_tokens=False))).start()
    base_url = server.base_url
    config = pipeline(tmp_path, base_url, local_model)
    with dg.DagsterInstance.ephemeral() as instance:
        try:
            first = materialize(config, instance, "responses", "B1")
            built = materialize(config, instance, "training_data")
        finally:
            server.stop()
        assert first["generated_now"] == 6 and built["reused"] is False
        assert built["tokenizer_agreement"] == "ok", built["tokenizer_agreement_detail"]
        with pytest.raises(httpx.ConnectError):
            httpx.get(base_url + "/models", timeout=5)

        again = materialize(config, instance, "responses", "B1")
        assert (again["generated_now"], again["rows"], again["server_capabilities"]) == (0, 6, "not probed")
        reused = materialize(config, instance, "training_data")
        assert reused["reused"] is True and reused["version"] == built["version"]
        assert reused["tokenizer_agreement"] == "ok", "as recorded by the run that checked it; no server asked"
        print(f"\nrerun with the server down: responses generated_now {again['generated_now']}, training_data {reused}")

        reseeded = pipeline(tmp_path, base_url, local_model, seed=1)
        rebuilt = materialize(reseeded, instance, "training_data")
        assert rebuilt["reused"] is False, "another seed is another identity: built again"
        assert rebuilt["tokenizer_agreement"] == "not checked" and "ConnectError" in str(
            rebuilt["tokenizer_agreement_detail"]
        ), "and the server (down) asked again"

        validating = pipeline(tmp_path, base_url, local_model, seed=1, validation=2)
        assert materialize(validating, instance, "training_data")["reused"] is False
        left_to_do = materialize(validating, instance, "training_data")
        assert left_to_do["reused"] is False, "the same identity, but its serving reference is still to record"
        assert str(left_to_do["serving_reference_status"]).startswith("not recorded")
