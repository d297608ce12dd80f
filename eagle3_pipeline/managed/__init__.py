"""Inference servers the pipeline runs itself (`serving.managed`): launch lines built from what the phases
need (:mod:`.launch`), the pipeline file's managed servers resolved (:mod:`.servers`), their life on the host
— start, ready, stop verified (:mod:`.lifecycle`) — what the phases ask of them (:mod:`.supervisor`), and
a generation server brought back when it dies or hangs mid-run (:mod:`.recovery`), and why a stopped one
does not close the health gate (:mod:`.gate`). No Dagster here: the
Dagster layer turns the typed results and events into run events and observations.

(:mod:`eagle3_pipeline.inference` holds the embedded profile's ``transformers serve``, which each run starts
itself, and the inference provider a `responses` run asks for its endpoints: it serves them from the managed
server.)
"""

from eagle3_pipeline.managed.errors import (
    AlreadyRunningError,
    GpusBusyError,
    HostUnreachableError,
    ManagedServerError,
    NotOurProcessError,
    PortInUseError,
    StartupFailedError,
    StopNotVerifiedError,
)
from eagle3_pipeline.managed.gate import SERVER_CHECKS, stopped_server
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
    ManagedServer,
    ProcessRef,
    ServerRecord,
    ServerStatus,
    StartResult,
    StopResult,
    StopVerification,
)
from eagle3_pipeline.managed.recovery import GenerationRecovery
from eagle3_pipeline.managed.servers import (
    GENERATION_ACCEPTS,
    ServerSetup,
    generation_purpose,
    launch_for,
    managed_server,
    managed_servers,
    prompts_need_tools,
    target_model_types,
)
from eagle3_pipeline.managed.supervisor import EventSink, ServerEvent, Supervisor, open_supervisor

__all__ = [
    "FAMILY_PARSERS",
    "GENERATION_ACCEPTS",
    "SERVER_CHECKS",
    "AlreadyRunningError",
    "EagleDrafter",
    "EngineSettings",
    "EventSink",
    "FamilyParsers",
    "GenerationRecovery",
    "GpusBusyError",
    "HiddenStateExtraction",
    "HostUnreachableError",
    "LaunchError",
    "LaunchLine",
    "ManagedServer",
    "ManagedServerError",
    "NotOurProcessError",
    "ParserChoice",
    "PortInUseError",
    "ProcessRef",
    "ServerPurpose",
    "ServerEvent",
    "ServerRecord",
    "ServerSetup",
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
    "generation_purpose",
    "launch_for",
    "managed_server",
    "managed_servers",
    "open_supervisor",
    "prompts_need_tools",
    "resolve_parser",
    "stopped_server",
    "target_model_types",
    "vllm_eagle3_config",
]
