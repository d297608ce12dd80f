"""Response generation: an OpenAI-compatible client with per-length-class concurrency over one or
several endpoints, retries, per-dataset token budgets, and a crash-safe checkpoint resumed by id.

The Dagster layer calls :func:`generate_dataset` (one dataset: generate, then write the table) and
the budget check calls :func:`table_budget_state`; :func:`generate` is the engine underneath.
:func:`partition_is_stale` says whether a dataset's responses are missing or were made under other
settings than the configured ones (for schedules and sensors).
"""

from eagle3_pipeline.generation.budget import BudgetState, budget_state
from eagle3_pipeline.generation.checkpoint import CheckpointError, ResponseCheckpoint
from eagle3_pipeline.generation.conversation import RESPONSE_TABLE_SCHEMA, response_rows
from eagle3_pipeline.generation.dataset import DatasetResult, generate_dataset, table_budget_state
from eagle3_pipeline.generation.endpoints import Endpoint, Price
from eagle3_pipeline.generation.fingerprint import FingerprintMismatch, configured_fingerprint, partition_is_stale
from eagle3_pipeline.generation.outcome import GenerationFailed, GenerationSummary, ServerLost
from eagle3_pipeline.generation.progress import Progress, ProgressSink, format_duration
from eagle3_pipeline.generation.recovery import Recovered, RecoveryFailed, ServerRecovery
from eagle3_pipeline.generation.runner import generate, generate_async

__all__ = [
    "RESPONSE_TABLE_SCHEMA",
    "BudgetState",
    "CheckpointError",
    "DatasetResult",
    "Endpoint",
    "FingerprintMismatch",
    "GenerationFailed",
    "GenerationSummary",
    "Price",
    "Progress",
    "ProgressSink",
    "Recovered",
    "RecoveryFailed",
    "ResponseCheckpoint",
    "ServerLost",
    "ServerRecovery",
    "budget_state",
    "configured_fingerprint",
    "format_duration",
    "generate",
    "generate_async",
    "generate_dataset",
    "partition_is_stale",
    "response_rows",
    "table_budget_state",
]
