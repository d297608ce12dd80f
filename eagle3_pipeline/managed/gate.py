"""A stopped managed server is not a sick one: the health gate lets generation launch on it.

The health tick of a host whose managed server is stopped fails the server's own checks (no process, the
port closed, no generation, no metrics, no progress). Refusing work for that would wait forever for a
server that only the run it refuses would start. :func:`stopped_server` says when such a report still
opens the gate: the pid file and ``/proc`` show no server of ours (no pid file, or its process exited)
and every failing check is one of the server's own. A running server that fails its checks (hung, GPU
errors), a failing check of the host (GPUs, disk, memory), processes left by a dead server, and a status
that cannot be read (no evidence is not health) keep the gate closed.
"""

from __future__ import annotations

from eagle3_pipeline.health import HealthReport
from eagle3_pipeline.managed.errors import ManagedServerError
from eagle3_pipeline.managed.lifecycle import ManagedServer

# The checks that fail only because the server is not running.
SERVER_CHECKS = frozenset({"server_process", "port", "generation", "throughput", "progress"})


def stopped_server(report: HealthReport, server: ManagedServer) -> str | None:
    """Why ``report`` (not healthy) still opens the gate: the managed server is stopped (module doc);
    None when it does not."""
    failing = {check.name for check in report.failing()}
    if not failing <= SERVER_CHECKS:
        return None
    try:
        status = server.status()
    except ManagedServerError:
        return None
    if status.state == "absent":
        return f"managed server {server.setup.name} not running ({status.detail})"
    if status.state == "exited":
        return f"managed server {server.setup.name} stopped: {status.detail}"
    return None
