"""A finished `drafter_benchmark` needs no server: its result is recorded with what produced it.

The identity of a benchmark is its settings, where the server is reached, the eval prompts (their token
ids) and the drafter it serves, by content: SHA-256 of every file of ``draft_model_path`` on the GPU
host, read over the hosts layer (no server is started for it). A rerun with the same identity returns
the recorded result; a drafter that was retrained, other prompts or other settings run the benchmark
again. A drafter folder that cannot be read gives no identity, and the benchmark runs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from eagle3_pipeline.compute import Reporter
from eagle3_pipeline.config import DrafterBenchmarkConfig
from eagle3_pipeline.drafter.serve.benchmark import Gate, run_benchmark
from eagle3_pipeline.drafter.serve.servers import ArmServers, benchmark_path
from eagle3_pipeline.drafter.serve.set_tau import PromptSetRun
from eagle3_pipeline.hosts import Host, quote_args
from eagle3_pipeline.records import atomic_path

DIGEST_TIMEOUT_S = 300.0


def drafter_digest(host: Host, folder: str) -> str | None:
    """SHA-256 over the ``sha256sum`` lines of every file under ``folder`` on ``host``; None if unreadable."""
    command = f"cd {quote_args(folder)} && find . -type f -print0 | sort -z | xargs -0 -r sha256sum"
    result = host.run(command, DIGEST_TIMEOUT_S)
    if result.exit_code != 0 or not result.stdout.strip():
        return None
    return hashlib.sha256(result.stdout.encode()).hexdigest()


def benchmark_identity(
    settings: DrafterBenchmarkConfig, base_url: str, prompts: Sequence[Sequence[int]], drafter: str
) -> dict[str, Any]:
    return {
        "settings": settings.model_dump(mode="json"),
        "base_url": base_url,
        "prompts": hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest(),
        "drafter": drafter,
    }


def recorded_result(path: Path, identity: Mapping[str, Any]) -> dict[str, Any] | None:
    """The metadata of the benchmark recorded at ``path`` for ``identity``, or None."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("identity") != identity or not isinstance(record.get("result"), dict):
        return None
    return record["result"]


def record_result(path: Path, identity: Mapping[str, Any], result: Mapping[str, Any]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"identity": dict(identity), "result": dict(result)}, indent=1))


def no_servers() -> AbstractContextManager[ArmServers | None]:
    return nullcontext(None)


def run_or_reuse(
    settings: DrafterBenchmarkConfig,
    host: Host,
    *,
    base_url: str,
    prompts: Sequence[Sequence[int]],
    gate: Gate,
    report: Reporter,
    record: Path,
    servers: Callable[[], AbstractContextManager[ArmServers | None]] = no_servers,
    sets: PromptSetRun | None = None,
) -> tuple[dict[str, Any], bool]:
    """The benchmark's metadata and whether it was reused: the result recorded at ``record`` for the
    same identity, else :func:`~eagle3_pipeline.drafter.serve.benchmark.run_benchmark` (recorded after) with the
    arms' servers ``servers()`` holds for the run (None: ``launch_command``'s)."""
    drafter = drafter_digest(host, benchmark_path(settings, "draft_model_path"))
    identity = benchmark_identity(settings, base_url, prompts, drafter) if drafter is not None else None
    kept = recorded_result(record, identity) if identity is not None else None
    if kept is not None:
        report.log(
            f"drafter_benchmark: reusing the result recorded in {record} for the same drafter (sha256 "
            f"{drafter[:12] if drafter else ''}), prompts and settings; no server started"
        )
        return kept, True
    with servers() as arms:
        metadata = run_benchmark(
            settings, host, base_url=base_url, prompts=prompts, gate=gate, report=report, servers=arms, sets=sets
        ).as_metadata()
    if identity is not None:
        record_result(record, identity, metadata)
    return metadata, False
