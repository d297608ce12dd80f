"""A pipeline file whose health section points at the loopback sshd and the fake SGLang server."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_pipeline.config import PipelineConfig, load_config
from eagle3_pipeline.testing.datasets import sharegpt, write_jsonl
from eagle3_pipeline.testing.fake_sglang import FakeSglang
from eagle3_pipeline.testing.sshd_fixture import Sshd


def write_config(
    tmp_path: Path, sshd: Sshd, sglang: FakeSglang, port: int | None = None, **health: object
) -> PipelineConfig:
    for name in ("B1", "B2"):
        write_jsonl(tmp_path / f"{name}.jsonl", [sharegpt(f"{name} question {i}") for i in range(3)])
    known_hosts = health.pop("known_hosts", sshd.known_hosts)
    settings = {
        "host": {
            "kind": "ssh",
            "hostname": "127.0.0.1",
            "port": port or sshd.port,
            "username": "root",
            "key_file": str(sshd.client_key),
            "known_hosts": str(known_hosts),
            "connect_timeout_s": 5,
        },
        "server": {"kind": "sglang", "port": sglang.port, "tp_size": 8},
        "expected_gpus": 8,
        "min_disk_free_gb": 0.01,
        "min_mem_free_gb": 0.01,
        "generation_timeout_s": 3,
        "max_truncation_rate": 1.0,
        **health,
    }
    document = {
        "name": "sensed",
        "artifacts_root": str(tmp_path / "out"),
        "target": {"model": "fake", "tokenizer": "unused"},
        "inference": {"kind": "endpoints", "endpoints": [{"base_url": sglang.base_url + "/v1"}]},
        "generation": {"length_estimator": "chars"},  # the fake server has no tokenizer
        "health": settings,
        "datasets": [{"id": "B1", "source": "B1.jsonl"}, {"id": "B2", "source": "B2.jsonl"}],
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(json.dumps(document))
    return load_config(path)
