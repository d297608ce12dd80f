"""Pipeline sections whose health section points at the loopback sshd and the fake SGLang server (a helper
module, not a test), for :func:`~eagle3_pipeline_tests.pipeline_files.write_pipeline`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_pipeline.testing.fake_sglang import FakeSglang
from eagle3_pipeline.testing.sshd_fixture import Sshd
from eagle3_pipeline_tests.pipeline_files import write_sources


def sensed_sections(
    tmp_path: Path, sshd: Sshd, sglang: FakeSglang, port: int | None = None, known_hosts: Path | None = None
) -> dict[str, Any]:
    """Generation against the fake SGLang server, watched over SSH (``port``: the sshd's or a proxy's), and
    three-prompt sources for its datasets B1 and B2."""
    health = {
        "host": {
            "kind": "ssh",
            "hostname": "127.0.0.1",
            "port": port or sshd.port,
            "username": "root",
            "key_file": str(sshd.client_key),
            "known_hosts": str(known_hosts or sshd.known_hosts),
            "connect_timeout_s": 5,
        },
        "server": {"kind": "sglang", "port": sglang.port, "tp_size": 8},
        "expected_gpus": 8,
        "generation_timeout_s": 3,
        "max_truncation_rate": 1.0,
    }
    return {
        "name": "sensed",
        "target": {"model": "fake", "tokenizer": "unused"},
        "inference": {"kind": "endpoints", "endpoints": [{"base_url": sglang.base_url + "/v1"}]},
        "generation": {"length_estimator": "chars"},  # the fake server has no tokenizer
        "health": health,
        "datasets": write_sources(tmp_path, "B1", "B2"),
    }
