"""Health checks of an inference host and the servers work is sent to: probes →
`HealthReport`.

Call `run_health_tick(host, spec, thresholds, state, targets)` once per tick; keep the returned
`TickState` (e.g. `state.to_json()` in a sensor cursor) and pass it to the next tick.

Layout: `checks/<name>.py` holds each check's rule (and what it collects), named as in
`CHECK_NAMES`; `script` is the one shell round trip that collects the host's sections; `http` the
client of the server probes; `tick` runs everything once under a deadline; `report` the verdicts.
Above the probes: `gate`, a pipeline's health gate (its config → host, server, thresholds; the preflight
before work is sent), and `alerts`, the webhook messages when something changes for the worse.
"""

from eagle3_pipeline.health.report import CheckResult, HealthReport, Status
from eagle3_pipeline.health.settings import CHECK_NAMES, GenerationTarget, HealthThresholds, ServerSpec, server_root
from eagle3_pipeline.health.tick import TickState, run_health_tick

__all__ = [
    "CHECK_NAMES",
    "CheckResult",
    "GenerationTarget",
    "HealthReport",
    "HealthThresholds",
    "ServerSpec",
    "Status",
    "TickState",
    "run_health_tick",
    "server_root",
]
