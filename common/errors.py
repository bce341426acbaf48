"""Errors that declare their status, and the one table of those statuses.

Code that knows what went wrong raises a domain error of one of the kinds below (a bad input, a full
service, a service that cannot answer now); `ERROR_STATUS` gives each kind its gRPC status and
`HTTP_STATUS_OF_GRPC` the HTTP status the gateway answers for it. A service turns any exception into the
status it sends with `as_service_error`: a ServiceError keeps its code, a domain error gets its kind's,
anything else is INTERNAL (a fault of ours). The engine layers raise these kinds without knowing gRPC.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """A failure with a definite gRPC status code; the server skeleton sends it as that status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}, {self.message!r})"


class UsageError(Exception):
    """A user error found after parsing (a port in use, a cache too small): one line on stderr, exit 2."""


class InvalidInputError(ValueError):
    """The client's input is wrong (INVALID_ARGUMENT with the message)."""


class CapacityError(RuntimeError):
    """The service is full for now (a queue, a cache): RESOURCE_EXHAUSTED; the caller may retry later."""


class UnavailableError(RuntimeError):
    """The service cannot answer now (stopping, a worker gone): UNAVAILABLE; retry, maybe elsewhere."""


# Each kind's gRPC status; a subclass takes its kind's. Only these (and ServiceError) leave a service
# with a status other than INTERNAL.
ERROR_STATUS: dict[type[BaseException], grpc.StatusCode] = {
    InvalidInputError: grpc.StatusCode.INVALID_ARGUMENT,
    CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnavailableError: grpc.StatusCode.UNAVAILABLE,
}

# The gateway's HTTP status for each gRPC status (API.md); any code not listed is a 500.
HTTP_STATUS_OF_GRPC: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status that exc calls for: a ServiceError's own, its kind's, else INTERNAL."""
    if isinstance(exc, ServiceError):
        return exc.code
    for cls in type(exc).__mro__:
        if cls in ERROR_STATUS:
            return ERROR_STATUS[cls]
    return grpc.StatusCode.INTERNAL


def as_service_error(exc: BaseException, prefix: str = "") -> ServiceError:
    """exc as the status a service sends; `prefix` says which part of the request failed ("image 2: ").
    An INTERNAL one names the exception's type, since its message alone may not say what happened."""
    if isinstance(exc, ServiceError):
        return exc if not prefix else ServiceError(exc.code, prefix + exc.message)
    code = status_of(exc)
    text = str(exc) if code != grpc.StatusCode.INTERNAL else f"{type(exc).__name__}: {exc}"
    return ServiceError(code, prefix + text)


def invalid_argument(message: str) -> ServiceError:
    """INVALID_ARGUMENT with message."""
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServiceError:
    """NOT_FOUND with message."""
    return ServiceError(grpc.StatusCode.NOT_FOUND, message)


def resource_exhausted(message: str) -> ServiceError:
    """RESOURCE_EXHAUSTED with message."""
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> ServiceError:
    """UNAVAILABLE with message."""
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)
