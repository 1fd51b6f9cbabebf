"""hpshard.Error and its per-status subclasses.

The SWIG module (hpshard.capi) builds the exception of a failing call through
``_from_status(status, message)``; keep that name.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """Mirror of hps_status_t (values are explicit in hpshard.h and never reused)."""

    OK = 0
    INVALID_ARGUMENT = 1
    OUT_OF_RANGE = 2
    NOT_FOUND = 3
    ALREADY_EXISTS = 4
    FAILED_PRECONDITION = 5
    UNIMPLEMENTED = 6
    UNAVAILABLE = 7
    TIMEOUT = 8
    ABORTED = 9
    OUT_OF_MEMORY = 10
    INTERNAL = 11
    BACKEND_ERROR = 12


class Error(Exception):
    """A failing hpshard call: ``status`` (int code), ``status_name``, ``message``."""

    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(status, message)
        self.status = int(status)
        self.message = message

    @property
    def status_name(self) -> str:
        """The status's name without prefix ("INVALID_ARGUMENT"), or "UNKNOWN(n)"."""
        try:
            return Status(self.status).name
        except ValueError:
            return f"UNKNOWN({self.status})"

    def __str__(self) -> str:
        return f"[{self.status_name}] {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status!r}, {self.message!r})"


class InvalidArgumentError(Error):
    """HPS_STATUS_INVALID_ARGUMENT."""


class OutOfRangeError(Error):
    """HPS_STATUS_OUT_OF_RANGE."""


class NotFoundError(Error):
    """HPS_STATUS_NOT_FOUND."""


class AlreadyExistsError(Error):
    """HPS_STATUS_ALREADY_EXISTS."""


class FailedPreconditionError(Error):
    """HPS_STATUS_FAILED_PRECONDITION."""


class UnavailableError(Error):
    """HPS_STATUS_UNAVAILABLE."""


class UnimplementedError(Error):
    """HPS_STATUS_UNIMPLEMENTED."""


class TimedOutError(Error):
    """HPS_STATUS_TIMEOUT (not Python's TimeoutError, an OSError)."""


class AbortedError(Error):
    """HPS_STATUS_ABORTED."""


class OutOfMemoryError(Error):
    """HPS_STATUS_OUT_OF_MEMORY."""


class InternalError(Error):
    """HPS_STATUS_INTERNAL."""


class BackendError(Error):
    """HPS_STATUS_BACKEND_ERROR."""


_SUBCLASSES: dict[int, type[Error]] = {
    Status.INVALID_ARGUMENT: InvalidArgumentError,
    Status.OUT_OF_RANGE: OutOfRangeError,
    Status.NOT_FOUND: NotFoundError,
    Status.ALREADY_EXISTS: AlreadyExistsError,
    Status.FAILED_PRECONDITION: FailedPreconditionError,
    Status.UNIMPLEMENTED: UnimplementedError,
    Status.UNAVAILABLE: UnavailableError,
    Status.TIMEOUT: TimedOutError,
    Status.ABORTED: AbortedError,
    Status.OUT_OF_MEMORY: OutOfMemoryError,
    Status.INTERNAL: InternalError,
    Status.BACKEND_ERROR: BackendError,
}


def _from_status(status: int, message: str) -> Error:
    """Called by the SWIG wrapper: the exception for a failing status."""
    return _SUBCLASSES.get(int(status), Error)(status, message)
