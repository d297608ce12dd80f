"""The optional `drafter_benchmark` asset: defined only when the pipeline file has `drafter_benchmark:`.

Asset → domain function: drafter_benchmark → eagle3_pipeline.drafter.serve.record.run_or_reuse (which runs
eagle3_pipeline.drafter.serve.benchmark.run_benchmark on the host of `health.host`, behind the same health gate as
generation, unless the result for the same drafter, prompts and settings is recorded). Its metadata: a Markdown
table and bar chart of tokens/s per arm and concurrency (eagle3_pipeline.drafter.serve.report). With a managed
server on that host its arms are the managed server's launch lines, with its GPUs handed over around them
(eagle3_pipeline.components.managed:hand_over; eagle3_pipeline.drafter.serve.benchmark:benchmark_settings).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg

from eagle3_pipeline.components.fit import fitted
from eagle3_pipeline.components.health.inference_server import health_observation, report_metadata
from eagle3_pipeline.components.managed import hand_over
from eagle3_pipeline.components.policy import step_policy
from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.drafter.serve.benchmark import benchmark_settings, eval_prompts, make_gate
from eagle3_pipeline.drafter.serve.client import BenchmarkError
from eagle3_pipeline.drafter.serve.prompt_sets import PromptSetError
from eagle3_pipeline.drafter.serve.record import no_servers, run_or_reuse
from eagle3_pipeline.drafter.serve.servers import ArmServers, ManagedServers
from eagle3_pipeline.drafter.serve.set_tau import prompt_set_run
from eagle3_pipeline.health.gate import UnhealthyError, thresholds_for
from eagle3_pipeline.hosts import TUNNELS, build_host
from eagle3_pipeline.layout import ArtifactLayout
from eagle3_pipeline.managed.tunnels import declare_route
from eagle3_pipeline.orchestration.heavy_phase import DagsterReporter
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames

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
            settings.chosen_concurrency,
            config.target.trust_remote_code,
        )
    except PromptSetError as exc:
        raise dg.Failure(description=str(exc)) from None
    host = build_host(config.health.host)
    drafter = str(settings.draft_model_path)

    @contextmanager
    def servers() -> Iterator[ArmServers | None]:
        """The managed server's GPUs for both arms, each arm its launch line (None: launch_command)."""
        with hand_over(context, config, names, "drafter_benchmark") as supervisor:
            yield ManagedServers(supervisor, drafter) if supervisor is not None else None

    try:
        metadata, reused = run_or_reuse(
            settings,
            host,
            base_url=base_url,
            prompts=prompts,
            gate=make_gate(host, thresholds_for(config.health, config.artifacts_root)),
            report=DagsterReporter(context),
            record=layout.drafter_benchmark,
            servers=servers if managed is not None else no_servers,
            sets=sets,
        )
    except UnhealthyError as exc:
        context.log_event(health_observation(exc.report, None, names))
        raise dg.Failure(description=str(exc), metadata=report_metadata(exc.report)) from None
    except BenchmarkError as exc:
        raise dg.Failure(description=str(exc)) from None
    finally:
        host.close()
        TUNNELS.close()
    return dg.MaterializeResult(metadata={**shown(metadata), "base_url": base_url, "reused": reused})


def shown(metadata: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's figures as the UI shows them: the table and the bar chart as Markdown; the arms, the
    choice, the configurations not run and the prompt sets' figures as JSON."""
    as_json = ("arms", "choice", "not_run", "tau_sets", "loop_flagged", "thinking")
    as_markdown = ("table", "chart")

    def value_of(name: str, value: Any) -> Any:
        if name in as_json and value is not None:
            return dg.MetadataValue.json(value)
        return dg.MetadataValue.md(str(value)) if name in as_markdown else value

    return {name: value_of(name, value) for name, value in metadata.items()}


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
        description=f"The target served by {described.server} without the drafter and with each speculative "
        f"configuration of the sweep (K={described.steps} first, at most {described.max_server_starts} server "
        f"starts) on the GPU host: output tokens/s, TTFT and ITL at concurrencies {described.concurrencies} over "
        f"{described.prompts} eval prompts, speedup with its bootstrap interval, τ as the server reports it, and "
        f"the configuration to serve at concurrency {described.chosen_concurrency}.",
        **step_policy(loaded, "drafter_benchmark"),
    )(drafter_benchmark)

    return [drafter_benchmark_asset]
