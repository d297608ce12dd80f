"""What runs by itself, for the whole pipeline: one sensor, `pipeline_automation` (running by
default), evaluates every asset's automation condition — the scheduled backfill of `responses`
(:mod:`eagle3_pipeline.components.generation.automation`) and :data:`FOLLOW_UPSTREAM`, which every phase
downstream of `responses` declares. A downstream phase reads *all* partitions of its input, so it
waits until none is missing or in progress, then runs once per change upstream.

The sensor runs in the code server (`use_user_code_server=True`), as Dagster requires for a
condition written in Python (`GenerationDue`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import dagster as dg

from eagle3_pipeline.orchestration.names import PipelineNames

AUTOMATION_SENSOR = "pipeline_automation"
AUTOMATION_INTERVAL_S = 30

# The condition every phase downstream of `responses` declares: run when an input changed (or the
# phase was never materialized), once no input partition is missing or being materialized. Not with
# `all_deps_blocking_checks_passed()`: it waits on every blocking check of every input, WARN ones
# included (hidden_states' serving_agreement fails as WARN when nothing was validated); each phase
# names the checks it refuses on itself (eagle3_pipeline.orchestration.gating).
FOLLOW_UPSTREAM = dg.AutomationCondition.eager()


def build_automation_sensor(
    names: PipelineNames, keys: Sequence[dg.AssetKey]
) -> dg.AutomationConditionSensorDefinition:
    """The automation sensor of one pipeline: it evaluates the conditions of the assets `keys` (the
    pipeline's own, so two pipelines in a code location have one sensor each)."""
    # `use_user_code_server` is a Beta parameter, and a condition written in Python (GenerationDue)
    # needs it: its BetaWarning is expected here, so it is silenced for this one call only.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*use_user_code_server.*", category=dg.BetaWarning)
        return dg.AutomationConditionSensorDefinition(
            names.name(AUTOMATION_SENSOR),
            target=dg.AssetSelection.assets(*keys),
            default_status=dg.DefaultSensorStatus.RUNNING,
            minimum_interval_seconds=AUTOMATION_INTERVAL_S,
            emit_backfills=True,
            use_user_code_server=True,
            description="Evaluates the automation conditions: the scheduled backfill of `responses` (when the "
            "pipeline file sets schedule.cron) and the phases that follow it.",
        )
