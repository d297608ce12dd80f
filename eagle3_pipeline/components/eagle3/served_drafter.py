"""The `served_drafter` asset: defined only when the pipeline runs its server itself (`serving.managed`, with
`serving.serve_drafter`); without a managed server there is nothing to relaunch, and the pipeline ends at
`drafter_eval` (and `drafter_benchmark`).

Asset → domain function: served_drafter → eagle3_pipeline.drafter.serve.served_drafter.serve_drafter, on the
managed server of the health host (eagle3_pipeline.components.managed:hand_over), with drafter_eval's latest figures.
"""

from typing import Any

import dagster as dg
import httpx

from eagle3_pipeline.components.fit import fitted
from eagle3_pipeline.components.managed import hand_over
from eagle3_pipeline.components.policy import step_policy
from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.drafter.serve.benchmark import BenchmarkError
from eagle3_pipeline.drafter.serve.served_drafter import ServedDrafterError, serve_drafter
from eagle3_pipeline.managed import managed_servers
from eagle3_pipeline.orchestration.heavy_phase import DagsterReporter
from eagle3_pipeline.orchestration.names import DEFAULT_NAMES, PipelineNames


def _figures(instance: dg.DagsterInstance, key: dg.AssetKey) -> dict[str, Any]:
    """The numbers of an asset's latest materialization ({} without one)."""
    event = instance.get_latest_materialization_event(key)
    if event is None or event.asset_materialization is None:
        return {}
    values = {name: value.value for name, value in event.asset_materialization.metadata.items()}
    return {name: v for name, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def served_drafter(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    resources = StepResources.of_asset(context)
    names = resources.names
    config = fitted(context, resources.config(), "served_drafter")
    evaluation = _figures(context.instance, names.key("drafter_eval"))
    with hand_over(context, config, names, "served_drafter") as supervisor:
        if supervisor is None:
            raise dg.Failure(
                description=f"{config.source_file}: no managed server runs on the health host (serving.managed) "
                "to serve the drafter"
            )
        try:
            result = serve_drafter(config, supervisor, evaluation, DagsterReporter(context))
        except (ServedDrafterError, BenchmarkError, httpx.HTTPError) as exc:
            raise dg.Failure(description=f"served_drafter: {exc}") from None
    return dg.MaterializeResult(metadata=result.as_metadata())


def build_served_drafter(loaded: PipelineConfig, names: PipelineNames = DEFAULT_NAMES) -> list[dg.AssetsDefinition]:
    setups = managed_servers(loaded)
    if not setups or not setups[0].serving.serve_drafter:
        return []
    upstream = ["drafter_eval", *(["drafter_benchmark"] if loaded.drafter_benchmark is not None else [])]

    served_drafter_asset = dg.asset(
        key_prefix=names.key_prefix,
        group_name=names.name("eagle3"),
        kinds={setups[0].engine},
        deps=[names.key(asset) for asset in upstream],
        required_resource_keys={names.pipeline},
        description="The managed server relaunched with the trained drafter when its τ (drafter_eval's, and the "
        "benchmark's from the server's counters when it ran) beats the drafter being served, or none is; the "
        "previous launch line is kept, and restored if the new server fails to start. Its metadata: the τ the "
        "served drafter reaches, from the server's own counters on a few eval prompts.",
        **step_policy(loaded, "served_drafter"),
    )(served_drafter)

    return [served_drafter_asset]
