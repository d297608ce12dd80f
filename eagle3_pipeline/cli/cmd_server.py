"""`eagle3-pipeline server status|stop`: the managed inference server's state from its pid file, or its
verified stop."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from eagle3_pipeline.config import ConfigError, load_config

SERVER_EXIT = {"running": 0, "absent": 3, "exited": 3, "orphaned": 1, "foreign": 1}


def _server_status_lines(plan: Any, status: Any) -> list[str]:
    lines = [f"managed server {plan.name} ({plan.engine}, {plan.setting}) on port {plan.port}: {status.state}"]
    record = status.record
    if record is not None:
        lines.append(
            f"  role {record.role}, pid {record.pid} (process group {record.pgid}), started {record.started_at}: "
            f"{record.reason}"
        )
        lines.append(f"  command: {shlex.join(record.argv)}")
        lines.append(f"  log: {record.log_path}")
    lines.append(f"  {status.detail}")
    return lines


def _stop_lines(result: Any) -> list[str]:
    check = result.verification
    if result.was_running:
        head = (
            f"stopped the {result.role} server (pid {result.pid}) on {result.host} in {result.duration_s:.1f} s "
            f"({', '.join(result.signals)})"
        )
    else:
        head = f"no server of the pipeline's was running on {result.host}"
    return [
        head,
        f"  verified: {len(check.processes_left)} process(es) of it left; port {check.port} "
        + ("free" if not check.port_holders else "held")
        + f"; GPUs {check.gpu_check}",
    ]


def cmd_server(args: argparse.Namespace) -> int:
    """`server status|stop`: the managed server's state from its pid file, or its verified stop."""
    try:
        config = load_config(args.config, runtime_checks=False)
    except ConfigError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 2
    from eagle3_pipeline.hosts import build_host
    from eagle3_pipeline.managed import ManagedServer, ManagedServerError, StopNotVerifiedError, managed_server

    plan = managed_server(config, args.host)
    if plan is None:
        where = f"inference host {args.host!r}" if args.host else "it"
        print(
            f"eagle3-pipeline: {config.source_file}: no managed server (serving.managed) for {where}: the pipeline "
            "starts and stops no server",
            file=sys.stderr,
        )
        return 2
    host = build_host(plan.host)
    try:
        server = ManagedServer(host, plan)
        if args.action == "status":
            status = server.status()
            print("\n".join(_server_status_lines(plan, status)))
            return SERVER_EXIT[status.state]
        print("\n".join(_stop_lines(server.stop("eagle3-pipeline server stop"))))
        return 0
    except StopNotVerifiedError as exc:
        print("\n".join(_stop_lines(exc.result)), file=sys.stderr)
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 1
    except ManagedServerError as exc:
        print(f"eagle3-pipeline: {exc}", file=sys.stderr)
        return 1
    finally:
        host.close()
