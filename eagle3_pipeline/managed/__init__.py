"""Inference servers the pipeline runs itself (`serving.managed`): launch lines built from what the phases
need (:mod:`.launch`), the pipeline file's managed servers resolved (:mod:`.plan`), their life on the host
— start, ready, stop verified (:mod:`.lifecycle`) — and what the phases ask of them (:mod:`.supervisor`).
No Dagster here: the Dagster layer turns the typed results and events into run events and observations.

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
from eagle3_pipeline.managed.lifecycle import (
    AlreadyRunningError,
    ManagedServer,
    ManagedServerError,
    NotOurProcessError,
    PortInUseError,
    ProcessRef,
    ServerRecord,
    ServerStatus,
    StartResult,
    StartupFailedError,
    StopNotVerifiedError,
    StopResult,
    StopVerification,
)
from eagle3_pipeline.managed.plan import (
    ManagedServerPlan,
    launch_for,
    managed_server,
    managed_servers,
    prompts_need_tools,
    target_model_types,
)
from eagle3_pipeline.managed.supervisor import EventSink, ServerEvent, Supervisor, open_supervisor

__all__ = [
    "FAMILY_PARSERS",
    "AlreadyRunningError",
    "EagleDrafter",
    "EngineSettings",
    "EventSink",
    "FamilyParsers",
    "HiddenStateExtraction",
    "LaunchError",
    "LaunchLine",
    "ManagedServer",
    "ManagedServerError",
    "ManagedServerPlan",
    "NotOurProcessError",
    "ParserChoice",
    "PortInUseError",
    "ProcessRef",
    "ServerPurpose",
    "ServerEvent",
    "ServerRecord",
    "ServerStatus",
    "StartResult",
    "StartupFailedError",
    "StopNotVerifiedError",
    "StopResult",
    "StopVerification",
    "Supervisor",
    "build_launch",
    "drafter_args",
    "extraction_args",
    "family_parsers",
    "launch_for",
    "managed_server",
    "managed_servers",
    "open_supervisor",
    "prompts_need_tools",
    "resolve_parser",
    "target_model_types",
    "vllm_eagle3_config",
]
