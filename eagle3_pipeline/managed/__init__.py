"""Inference servers the pipeline runs itself (`serving.managed`): launch lines built from what the phases
need (:mod:`.launch`) and the pipeline file's managed servers resolved (:mod:`.plan`). No Dagster here.

(``eagle3_pipeline.serving`` is the embedded profile's ``transformers serve``, which each run starts itself.)
"""

from eagle3_pipeline.managed.launch import (
    FAMILY_PARSERS,
    EagleDrafter,
    EngineSettings,
    FamilyParsers,
    HiddenStateExtraction,
    LaunchError,
    LaunchLine,
    ParserChoice,
    ServerPurpose,
    build_launch,
    drafter_args,
    extraction_args,
    family_parsers,
    resolve_parser,
    vllm_eagle3_config,
)
from eagle3_pipeline.managed.plan import (
    ManagedServerPlan,
    launch_for,
    managed_server,
    managed_servers,
    prompts_need_tools,
    target_model_types,
)

__all__ = [
    "FAMILY_PARSERS",
    "EagleDrafter",
    "EngineSettings",
    "FamilyParsers",
    "HiddenStateExtraction",
    "LaunchError",
    "LaunchLine",
    "ManagedServerPlan",
    "ParserChoice",
    "ServerPurpose",
    "build_launch",
    "drafter_args",
    "extraction_args",
    "family_parsers",
    "launch_for",
    "managed_server",
    "managed_servers",
    "prompts_need_tools",
    "resolve_parser",
    "target_model_types",
    "vllm_eagle3_config",
]
