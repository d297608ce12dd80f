"""What goes wrong with a managed server (:mod:`.lifecycle`): each error's message says what and where."""

from __future__ import annotations

from eagle3_pipeline.hosts import HostError
from eagle3_pipeline.managed.outcomes import StopResult


class ManagedServerError(RuntimeError):
    """A managed server could not be started, identified or stopped; the message says what and where."""


class HostUnreachableError(ManagedServerError):
    """The host could not be reached (``cause``: the SSH error), or its dropped connection was not reopened
    within ``serving.reconnect_timeout_s``."""

    def __init__(self, message: str, cause: HostError) -> None:
        super().__init__(message)
        self.cause = cause


class GpusBusyError(ManagedServerError):
    """The host's GPUs are not free before a start (per-GPU memory and the holders in the message)."""


class AlreadyRunningError(ManagedServerError):
    """A server the pipeline started is running already."""


class PortInUseError(ManagedServerError):
    """Something listens on the server's port already (named in the message)."""


class StartupFailedError(ManagedServerError):
    """The server exited during start-up, or did not get ready in time; the message carries its log's tail."""

    def __init__(self, message: str, log_tail: str, stop: StopResult | None = None) -> None:
        super().__init__(message)
        self.log_tail = log_tail
        self.stop = stop


class NotOurProcessError(ManagedServerError):
    """The pid file names a live process that is not the one the pipeline started: nothing was signalled."""


class StopNotVerifiedError(ManagedServerError):
    """Signals were sent, but a process, the port or GPU memory is still held (named in the message)."""

    def __init__(self, message: str, result: StopResult) -> None:
        super().__init__(message)
        self.result = result
