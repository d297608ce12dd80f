"""The inference servers as observed assets: `inference_server` (or one per host of
`inference.hosts`), and the observations recorded on it: each health tick or preflight's report, and
each start, stop, reuse or failure of a managed server (so the UI shows who held the GPUs when)."""

import inspect
import warnings
from typing import Any

import dagster as dg

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.health import HealthReport
from eagle3_pipeline.health.report import report_markdown, tokens_per_second
from eagle3_pipeline.managed import ServerEvent
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames

INFERENCE_SERVER = "inference_server"


def report_metadata(report: HealthReport) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "overall": report.overall.value,
        "healthy": report.healthy,
        "summary": report.summary(),
        "report": dg.MetadataValue.md(report_markdown(report)),
    }
    metadata.update({f"check/{c.name}": c.status.value for c in report.checks})
    rate = tokens_per_second(report)
    if rate is not None:
        metadata["tokens_per_s"] = round(rate, 1)
    return metadata


def server_key(host: str | None = None, names: PipelineNames = DEFAULT_NAMES) -> dg.AssetKey:
    """`inference_server`, or `inference_server/<host>` for one of several inference hosts (under the
    prefix of `names`, if any)."""
    server = names.key(INFERENCE_SERVER)
    return server if host is None else dg.AssetKey([*server.path, host])


def inference_server_specs(config: PipelineConfig, names: PipelineNames = DEFAULT_NAMES) -> list[dg.AssetSpec]:
    """`inference_server`, and one observed asset per host of `inference.hosts`."""
    inference_server = dg.AssetSpec(
        server_key(None, names),
        group_name=names.name("target"),
        metadata=observed_where(),
        description="The inference host and server. Not materialized: each health tick records an "
        "observation carrying the report (per-check status, GPU table, tokens/s).",
    )
    return [inference_server] + [
        dg.AssetSpec(
            server_key(host.name, names),
            group_name=names.name("target"),
            metadata=observed_where(),
            description=f"Inference host {host.name!r} (pool {host.pool_name}): each health tick records an "
            "observation carrying its report; while it is not healthy it receives no new `responses` partition.",
        )
        for host in config.inference.hosts
    ]


def observed_where() -> dict[str, dg.CodeReferencesMetadataValue]:
    """An observed server's code reference: :func:`health_observation`, which makes every observation
    of it (an AssetSpec has no function of its own for `dg.with_source_code_references` to point at)."""
    with warnings.catch_warnings():  # code references are a beta feature of Dagster
        warnings.filterwarnings("ignore", r".*`(LocalFileCodeReference|CodeReferencesMetadataValue)`", dg.BetaWarning)
        line = inspect.getsourcelines(health_observation)[1]
        reference = dg.LocalFileCodeReference(file_path=__file__, line_number=line)
        return {"dagster/code_references": dg.CodeReferencesMetadataValue(code_references=[reference])}


def health_observation(
    report: HealthReport, host: str | None = None, names: PipelineNames = DEFAULT_NAMES
) -> dg.AssetObservation:
    metadata = report_metadata(report) if host is None else {"host": host, **report_metadata(report)}
    return dg.AssetObservation(asset_key=server_key(host, names), metadata=metadata)


def server_event_observation(
    event: ServerEvent, host: str | None = None, names: PipelineNames = DEFAULT_NAMES
) -> dg.AssetObservation:
    """A managed server's event (started, stopped, kept, failed, probed) on the `inference_server` asset of
    `host` (None: the single implicit one), with the event's line, reason, duration and figures, and who
    holds the GPUs afterwards (the role now served, or none)."""
    metadata: dict[str, Any] = {"summary": event.line(), "server": event.server, "role": event.role}
    metadata.update(event.as_metadata())
    metadata["gpus_held_by"] = (event.role if event.action in ("started", "kept", "probed") else None) or "none"
    if host is not None:
        metadata["inference_host"] = host
    return dg.AssetObservation(asset_key=server_key(host, names), metadata=metadata)
