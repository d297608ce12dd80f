"""How a command ends when something goes wrong: one line on stderr saying what and what to do, and an exit
code from :class:`ExitCode` (docs/operations.md lists them)."""

from __future__ import annotations

import sys
import traceback
from enum import IntEnum
from pathlib import Path

from eagle3_pipeline.config import ConfigError
from eagle3_pipeline.hosts import HostAuthError, HostConnectError, HostDisconnectedError, HostError, HostKeyError


class ExitCode(IntEnum):
    OK = 0
    UNHEALTHY = 1  # status critical/unknown, a server left behind or a stop unverified, a failed run, no fit
    BAD_INPUT = 2  # the pipeline file or the command line is wrong (no managed server, unknown --host)
    NOT_RUNNING = 3  # server status: the managed server is not running
    HOST_UNREACHABLE = 4  # the host cannot be connected to, or the connection dropped
    HOST_KEY = 5  # the host's key is unknown or changed
    HOST_AUTH = 6  # the host refused our credentials
    UNEXPECTED = 70  # an error the command does not expect: a bug (sysexits' EX_SOFTWARE)


HOST_ERROR_CODES = {
    cls.__name__: code
    for cls, code in (
        (HostError, ExitCode.HOST_UNREACHABLE),
        (HostConnectError, ExitCode.HOST_UNREACHABLE),
        (HostDisconnectedError, ExitCode.HOST_UNREACHABLE),
        (HostKeyError, ExitCode.HOST_KEY),
        (HostAuthError, ExitCode.HOST_AUTH),
    )
}


def fail(message: str, code: ExitCode, file: Path | None = None) -> int:
    """Print ``message`` as one line on stderr (after the pipeline file, if given); return ``code``."""
    where = f"{file}: " if file is not None else ""
    print(f"eagle3-pipeline: {where}{' '.join(message.split())}", file=sys.stderr)
    return code


def report(exc: Exception, file: Path | None = None, debug: bool = False) -> int:
    """One line for an exception that ends a command (after its traceback with ``debug``), and its exit code."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, HostError):
        return fail(str(exc), HOST_ERROR_CODES.get(type(exc).__name__, ExitCode.HOST_UNREACHABLE), file)
    if isinstance(exc, ConfigError):
        return fail(str(exc), ExitCode.BAD_INPUT)
    return fail(
        f"unexpected {type(exc).__name__}: {exc} (rerun with --debug before the command for the traceback, and "
        "report it with that traceback)",
        ExitCode.UNEXPECTED,
        file,
    )
