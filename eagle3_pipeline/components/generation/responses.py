"""`responses`: the target's answers to one dataset's prompts (a partition), by
eagle3_pipeline.generation.generate_dataset, checkpointed one by one, with a live throughput series; its
checks are in :mod:`.checks`."""

from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import dagster as dg

from eagle3_pipeline.components.fit import fitted
from eagle3_pipeline.components.generation.prompts import preview
from eagle3_pipeline.components.health.inference_server import (
    health_observation,
    report_metadata,
    server_event_observation,
)
from eagle3_pipeline.components.policy import step_policy
from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.generation import (
    DatasetResult,
    Endpoint,
    GenerationFailed,
    Progress,
    ProgressSink,
    ServerLost,
    generate_dataset,
)
from eagle3_pipeline.generation.capabilities import CapabilityMissing
from eagle3_pipeline.generation.fingerprint import FingerprintMismatch, configured_fingerprint
from eagle3_pipeline.generation.heartbeat import HeartbeatWriter, heartbeat_path
from eagle3_pipeline.generation.planning import dataset_plan
from eagle3_pipeline.health.alerts import Alerter, budget_reached, server_lost
from eagle3_pipeline.health.gate import UnhealthyError
from eagle3_pipeline.inference.provider import ManagedGeneration
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed import ManagedServerError, ServerEvent
from eagle3_pipeline.orchestration.names import PipelineNames
from eagle3_pipeline.records import read_prompts

HEARTBEAT_EVERY_S = 5.0


def _series_table(series: Sequence[dict[str, float]]) -> dg.MetadataValue:
    columns = ["elapsed_s", "done", "completion_tokens", "tokens_per_s", "requests_per_s"]
    return dg.MetadataValue.table(
        records=[dg.TableRecord({c: point[c] for c in columns}) for point in series],
        schema=dg.TableSchema(columns=[dg.TableColumn(c, "float") for c in columns]),
    )


def _observation(context: dg.AssetExecutionContext, p: Progress) -> dg.AssetObservation:
    """One point of the live throughput series, plotted by the UI across observations; it carries
    every field of the snapshot (`eagle3-pipeline run` hears the same snapshot through its listener)."""
    metadata: dict[str, Any] = {k: v for k, v in asdict(p).items() if k != "dataset"}
    metadata["tokens_per_s"] = round(p.tokens_per_s, 2)
    return dg.AssetObservation(asset_key=context.asset_key, partition=context.partition_key, metadata=metadata)


def responses(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    resources = StepResources.of_asset(context)
    config = fitted(context, resources.config(), "responses")
    dataset = config.dataset(context.partition_key)
    inference = resources.inference
    host = inference.host
    heartbeat = HeartbeatWriter(heartbeat_path(config.artifacts_root, dataset.id), context.run.run_id)

    def server_event(event: ServerEvent) -> None:
        context.log.info(event.line())
        context.log_event(server_event_observation(event, host, resources.names))

    # A managed server is made to serve generation when work is left (endpoints() is asked only then),
    # brought back if it dies mid-run, and left running afterwards.
    managed = ManagedGeneration(f"responses {dataset.id}", server_event) if inference.managed else None

    def endpoints() -> list[Endpoint]:
        resolved = inference.endpoints(managed)
        heartbeat.start()
        return resolved

    result = _generate(
        context,
        resources,
        config=config,
        dataset_id=dataset.id,
        endpoints=endpoints,
        heartbeat=heartbeat,
        managed=managed,
    )
    on_host = config.for_host(host)
    if inference.preflight_report is not None:
        context.log_event(health_observation(inference.preflight_report, host, resources.names))
    for check in result.capabilities.checks if result.capabilities is not None else []:
        log = context.log.warning if check.status == "missing" else context.log.info
        log(f"server capability {check.line}")
    budget_reached(Alerter.for_pipeline(config, context.log.warning), dataset.id, result.as_metadata())
    if result.kept_aside is not None:
        context.log.warning(
            f"{dataset.id}: generation settings changed; the old answers are kept in {result.kept_aside}"
        )
    resources.listener.result("responses", dataset.id, result.result)
    return _responses_result(config, on_host, dataset.id, result)


def _generate(
    context: dg.AssetExecutionContext,
    resources: StepResources,
    *,
    config: PipelineConfig,
    dataset_id: str,
    endpoints: Callable[[], list[Endpoint]],
    heartbeat: HeartbeatWriter,
    managed: ManagedGeneration | None,
) -> DatasetResult:
    """`responses`' call of the generation engine, each of its errors a step failure with its figures."""
    inference = resources.inference
    host = inference.host
    on_host = config.for_host(host)
    dataset = config.dataset(dataset_id)
    layout = ArtifactLayout(config.artifacts_root)

    def report(p: Progress) -> None:
        context.log.info(p.line())
        context.log_event(_observation(context, p))
        resources.listener.progress(p)

    sinks = [
        ProgressSink(config.generation.progress_interval_s, report),
        ProgressSink(HEARTBEAT_EVERY_S, lambda p: heartbeat.beat(p.done)),
    ]
    try:
        tokenizer = inference.tokenizer_name() if config.generation.length_estimator == "tokenizer" else None
        return generate_dataset(
            dataset,
            config.generation,
            target=config.target,
            inference=on_host.inference,
            layout=layout,
            prompts=read_prompts(layout.prompts(dataset.id)),
            resolve_endpoints=endpoints,
            sinks=sinks,
            tokenizer_name=tokenizer,
            host=host,
            tokenize_check=config.inference.kind == "endpoints" and config.training_data.tokenizer_check_samples > 0,
            recovery=inference.recovery(managed),
        )
    except CapabilityMissing as exc:
        raise dg.Failure(description=str(exc), metadata={"server_capabilities": exc.report.as_metadata()}) from None
    except FingerprintMismatch as exc:
        fingerprint = configured_fingerprint(config.generation, config.target, config.inference)
        raise dg.Failure(description=str(exc), metadata={"fingerprint": fingerprint.fields()}) from None
    except UnhealthyError as exc:
        context.log_event(health_observation(exc.report, host, resources.names))
        raise dg.Failure(description=str(exc), metadata=report_metadata(exc.report)) from None
    except ManagedServerError as exc:
        raise dg.Failure(description=str(exc)) from None
    except ServerLost as exc:
        alerter = Alerter.for_pipeline(on_host, context.log.warning)
        server_lost(alerter, host or "serving", context.run.run_id, str(exc))
        raise dg.Failure(description=str(exc), metadata=exc.summary.as_metadata()) from None
    except GenerationFailed as exc:
        raise dg.Failure(description=str(exc), metadata=exc.summary.as_metadata()) from None


def _responses_result(
    config: PipelineConfig, on_host: PipelineConfig, dataset_id: str, result: DatasetResult
) -> dg.MaterializeResult:
    layout = ArtifactLayout(config.artifacts_root)
    return dg.MaterializeResult(
        data_version=dg.DataVersion(result.data_version),
        metadata={
            **result.result.as_metadata(),
            "throughput_series": _series_table(result.summary.series),
            "path": dg.MetadataValue.path(str(layout.responses(dataset_id))),
            "checkpoint": dg.MetadataValue.path(str(layout.checkpoint(dataset_id))),
            "errors_file": dg.MetadataValue.path(str(layout.errors(dataset_id))),
            "preview": preview(result.rows, ["id", "finish_reason", "completion_tokens", "response"]),
            "plan": dg.MetadataValue.md(dataset_plan(on_host, dataset_id).markdown(dataset_id)),
        },
    )


def build_responses(
    loaded: PipelineConfig,
    names: PipelineNames,
    *,
    partitions: dg.PartitionsDefinition,
    backfill: dg.AutomationCondition | None,
    deps: Sequence[dg.AssetsDefinition],
) -> dg.AssetsDefinition:
    """The asset, one partition per dataset, after `deps` (prompts, and target_model when embedded); its code
    version the digest of the file's generation fingerprint."""
    return dg.asset(
        key_prefix=names.key_prefix,
        partitions_def=partitions,
        group_name=names.name("data"),
        kinds={"parquet"},
        deps=deps,
        required_resource_keys={names.pipeline, names.inference, names.phase_listener},
        automation_condition=backfill,
        code_version=configured_fingerprint(loaded.generation, loaded.target, loaded.inference).digest,
        description="The target model's answer to every prompt of one dataset. Each finished answer is "
        "checkpointed at once; a rerun resumes by id with no duplicates. A managed server is started when "
        "work is left, restarted if it dies mid-run (bounded), and left running. The code version is the digest of "
        "the generation fingerprint (model, max_tokens, temperature, reasoning, regenerate_turns); each "
        "materialization's data version is the fingerprint its answers actually have, plus their ids.",
        **step_policy(loaded, "responses"),
    )(responses)
