"""The optional `drafter_benchmark` asset: defined only when the pipeline file has `drafter_benchmark:`.

Asset → domain function: drafter_benchmark → eagle3_pipeline.drafter.benchmark_record.run_or_reuse (which runs
eagle3_pipeline.drafter.online.run_benchmark on the host of `health.host`, behind the same health gate as
generation, unless the result for the same drafter, prompts and settings is recorded). With a managed server
on that host its two arms are the managed server's launch lines, with its GPUs handed over around them
(eagle3_pipeline.components.managed:hand_over; eagle3_pipeline.drafter.online:benchmark_settings).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

from eagle3_pipeline.components.fit import fitted
from eagle3_pipeline.components.health.observations import health_observation, report_metadata
from eagle3_pipeline.components.managed import hand_over
from eagle3_pipeline.components.policy import step_policy
from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.drafter.benchmark_record import no_servers, run_or_reuse
from eagle3_pipeline.drafter.online import (
    ArmServers,
    BenchmarkError,
    ManagedServers,
    benchmark_settings,
    eval_prompts,
    make_gate,
)
from eagle3_pipeline.drafter.prompt_sets import PromptSetError
from eagle3_pipeline.drafter.set_tau import prompt_set_run
from eagle3_pipeline.hosts import TUNNELS, build_host
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed import EagleDrafter
from eagle3_pipeline.managed.tunnels import declare_route
from eagle3_pipeline.orchestration.heavy_phase import DagsterReporter
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames
from eagle3_pipeline.watch.monitor import UnhealthyError, thresholds_for

UPSTREAM = ("eagle3_drafter", "training_data")


def drafter_benchmark(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    resources = StepResources.of_asset(context)
    names = resources.names
    config = fitted(context, resources.config(), "drafter_benchmark")
    if config.drafter_benchmark is None:
        raise dg.Failure(
            description=f"{config.source_file}: drafter_benchmark: the section was removed since the code location "
            "loaded; reload it"
        )
    try:
        settings, managed = benchmark_settings(config)
    except BenchmarkError as exc:
        raise dg.Failure(description=str(exc)) from None
    base_url = settings.base_url or f"http://{config.health.host.hostname or '127.0.0.1'}:{settings.port}"
    if managed is None and settings.base_url is None:
        declare_route(base_url, config.health.host, settings.port)  # its arms bind the host's loopback
    layout = ArtifactLayout(config.artifacts_root)
    prompts = eval_prompts(layout.training_data, settings.prompts)
    try:
        sets = prompt_set_run(
            settings.prompt_sets,
            layout.training_data,
            settings.max_tokens,
            settings.concurrency,
            config.target.trust_remote_code,
        )
    except PromptSetError as exc:
        raise dg.Failure(description=str(exc)) from None
    host = build_host(config.health.host)
    drafter = EagleDrafter(str(settings.draft_model_path), settings.steps)

    @contextmanager
    def servers() -> Iterator[ArmServers | None]:
        """The managed server's GPUs for both arms, each arm its launch line (None: launch_command)."""
        with hand_over(context, config, names, "drafter_benchmark") as supervisor:
            yield ManagedServers(supervisor, drafter) if supervisor is not None else None

    try:
        metadata, reused = run_or_reuse(
            settings,
            host,
            base_url,
            prompts,
            make_gate(host, thresholds_for(config.health, config.artifacts_root)),
            DagsterReporter(context),
            layout.drafter_benchmark,
            servers if managed is not None else no_servers,
            sets,
        )
    except UnhealthyError as exc:
        context.log_event(health_observation(exc.report, None, names))
        raise dg.Failure(description=str(exc), metadata=report_metadata(exc.report)) from None
    except BenchmarkError as exc:
        raise dg.Failure(description=str(exc)) from None
    finally:
        host.close()
        TUNNELS.close()
    metadata["arms"] = dg.MetadataValue.json(metadata["arms"])
    for key in ("tau_sets", "loop_flagged", "thinking"):
        if metadata.get(key) is not None:
            metadata[key] = dg.MetadataValue.json(metadata[key])
    return dg.MaterializeResult(metadata={**metadata, "base_url": base_url, "reused": reused})


def build_drafter_benchmark(loaded: PipelineConfig, names: PipelineNames = DEFAULT_NAMES) -> list[dg.AssetsDefinition]:
    described = loaded.drafter_benchmark
    if described is None:
        return []

    drafter_benchmark_asset = dg.asset(
        key_prefix=names.key_prefix,
        group_name=names.name("eagle3"),
        kinds={described.server},
        deps=[names.key(asset) for asset in UPSTREAM],
        required_resource_keys={names.pipeline},
        description=f"The target served by {described.server} without and with the exported drafter "
        f"(K={described.steps}) on the GPU host; τ as the server reports it and tokens/s of both over "
        f"{described.prompts} eval prompts.",
        **step_policy(loaded, "drafter_benchmark"),
    )(drafter_benchmark)

    return [drafter_benchmark_asset]
