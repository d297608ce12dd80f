"""Health checks of an inference host and server (DESIGN §3): probes → `HealthReport`.

Call `run_health_tick(host, spec, thresholds, state)` once per tick; keep the returned
`TickState` (e.g. `state.to_json()` in a sensor cursor) and pass it to the next tick.
"""

from eagle3_pipeline.health.probes import TickState, run_health_tick
from eagle3_pipeline.health.report import CheckResult, HealthReport, Status
from eagle3_pipeline.health.settings import CHECK_NAMES, HealthThresholds, ServerSpec

__all__ = [
    "CHECK_NAMES",
    "CheckResult",
    "HealthReport",
    "HealthThresholds",
    "ServerSpec",
    "Status",
    "TickState",
    "run_health_tick",
]
