"""`eagle3-pipeline server status|stop`: the managed inference server's state from its pid file, or its
verified stop."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from eagle3_pipeline.cli.errors import HOST_ERROR_CODES, ExitCode, fail, report
from eagle3_pipeline.cli.shared import load_or_report

SERVER_EXIT = {
    "running": ExitCode.OK,
    "absent": ExitCode.NOT_RUNNING,
    "exited": ExitCode.NOT_RUNNING,
    "orphaned": ExitCode.UNHEALTHY,
    "foreign": ExitCode.UNHEALTHY,
}


def _server_status_lines(setup: Any, status: Any) -> list[str]:
    lines = [f"managed server {setup.name} ({setup.engine}, {setup.setting}) on port {setup.port}: {status.state}"]
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
        + f"; GPUs {check.gpu_check}; GPU memory {check.gpu_memory_check}",
    ]


def cmd_server(args: argparse.Namespace) -> int:
    """`server status|stop`: the managed server's state from its pid file, or its verified stop."""
    config = load_or_report(args, runtime_checks=False)
    if config is None:
        return ExitCode.BAD_INPUT
    from eagle3_pipeline.hosts import HostError, build_host
    from eagle3_pipeline.managed import (
        HostUnreachableError,
        ManagedServer,
        ManagedServerError,
        StopNotVerifiedError,
        managed_server,
    )

    setup = managed_server(config, args.host)
    if setup is None:
        where = f"inference host {args.host!r}" if args.host else "it"
        return fail(
            f"no managed server (serving.managed) for {where}: the pipeline starts and stops no server; "
            "set serving.managed: true to have it run one",
            ExitCode.BAD_INPUT,
            config.source_file,
        )
    host = build_host(setup.host)
    try:
        server = ManagedServer(host, setup)
        if args.action == "status":
            status = server.status()
            print("\n".join(_server_status_lines(setup, status)))
            return SERVER_EXIT[status.state]
        print("\n".join(_stop_lines(server.stop("eagle3-pipeline server stop"))))
        return 0
    except StopNotVerifiedError as exc:
        print("\n".join(_stop_lines(exc.result)), file=sys.stderr)
        return fail(str(exc), ExitCode.UNHEALTHY)
    except HostUnreachableError as exc:
        code = HOST_ERROR_CODES.get(type(exc.cause).__name__, ExitCode.HOST_UNREACHABLE)
        return fail(str(exc), code, config.source_file)
    except ManagedServerError as exc:
        return fail(str(exc), ExitCode.UNHEALTHY)
    except HostError as exc:
        return report(exc, config.source_file, args.debug)
    finally:
        host.close()
