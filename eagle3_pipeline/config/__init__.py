"""The pipeline file: one validated, typed model per section, and the loader.

``PipelineConfig`` (``pipeline.py``) is the root; each section's models live in the module named
after it (``generation``, ``inference``, ``serving``, ``health``, ``compute``, ``eagle3``, ``drafter``,
``ops``); ``loader.load_config`` reads a file into it. Every field is documented by its description, from
which ``reference.render()`` generates ``docs/settings.md``.
"""

from eagle3_pipeline.config.base import DATASET_ID_PATTERN, ENV_VAR_PATTERN, ConfigError, ConfigModel
from eagle3_pipeline.config.compute import COMMAND_PLACEHOLDERS, ComputeConfig
from eagle3_pipeline.config.drafter import (
    BENCHMARK_PLACEHOLDERS,
    BenchmarkPromptSetsConfig,
    DrafterBenchmarkConfig,
    DrafterConfig,
    DrafterEvalConfig,
    DrafterModelConfig,
)
from eagle3_pipeline.config.eagle3 import (
    DraftVocabConfig,
    HiddenStatesConfig,
    ServingValidationConfig,
    TrainingDataConfig,
)
from eagle3_pipeline.config.generation import (
    ConcurrencyConfig,
    DatasetConfig,
    FailoverConfig,
    GenerationConfig,
    PromptsConfig,
    RetryConfig,
)
from eagle3_pipeline.config.health import (
    SENSOR_ONLY_HEALTH_FIELDS,
    CheckName,
    HealthConfig,
    HostConfig,
    MonitoredServerConfig,
)
from eagle3_pipeline.config.inference import (
    HOST_NAME_PATTERN,
    EmbeddedServerConfig,
    EndpointConfig,
    InferenceConfig,
    InferenceHostConfig,
    PriceConfig,
    TargetConfig,
)
from eagle3_pipeline.config.loader import (
    ARTIFACTS_ENV_VAR,
    LOCAL_PROFILE,
    load_config,
    local_profile_path,
)
from eagle3_pipeline.config.machine import MachineConfig
from eagle3_pipeline.config.ops import (
    CRON_PATTERN,
    POOL_NAME_PATTERN,
    AlertsConfig,
    DeployConfig,
    GpuPoolConfig,
    LaunchConfig,
    ScheduleConfig,
)
from eagle3_pipeline.config.phases import GpuPhase
from eagle3_pipeline.config.pipeline import PipelineConfig, check_runtime, check_secrets, check_sources
from eagle3_pipeline.config.serving import DEFAULT_PORTS, Engine, ServingConfig

__all__ = [
    "ARTIFACTS_ENV_VAR",
    "BENCHMARK_PLACEHOLDERS",
    "COMMAND_PLACEHOLDERS",
    "CRON_PATTERN",
    "DEFAULT_PORTS",
    "DATASET_ID_PATTERN",
    "ENV_VAR_PATTERN",
    "HOST_NAME_PATTERN",
    "LOCAL_PROFILE",
    "POOL_NAME_PATTERN",
    "SENSOR_ONLY_HEALTH_FIELDS",
    "AlertsConfig",
    "CheckName",
    "ComputeConfig",
    "ConcurrencyConfig",
    "ConfigError",
    "ConfigModel",
    "DatasetConfig",
    "DeployConfig",
    "DraftVocabConfig",
    "BenchmarkPromptSetsConfig",
    "DrafterBenchmarkConfig",
    "DrafterConfig",
    "DrafterEvalConfig",
    "DrafterModelConfig",
    "EmbeddedServerConfig",
    "EndpointConfig",
    "Engine",
    "FailoverConfig",
    "GenerationConfig",
    "GpuPhase",
    "MachineConfig",
    "GpuPoolConfig",
    "HealthConfig",
    "HiddenStatesConfig",
    "HostConfig",
    "InferenceConfig",
    "InferenceHostConfig",
    "LaunchConfig",
    "MonitoredServerConfig",
    "PipelineConfig",
    "PriceConfig",
    "PromptsConfig",
    "RetryConfig",
    "ScheduleConfig",
    "ServingConfig",
    "ServingValidationConfig",
    "TargetConfig",
    "TrainingDataConfig",
    "check_runtime",
    "check_secrets",
    "check_sources",
    "load_config",
    "local_profile_path",
]
