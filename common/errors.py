"""Errors that carry their gRPC status from the code that knows it to the interceptor that sends it."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """A failure with a definite gRPC status code; the server skeleton sends it as that status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"ServiceError({self.code.name}, {self.message!r})"


class UsageError(Exception):
    """A user error found after parsing (a port in use, a cache too small): one line on stderr, exit 2."""


class InvalidInputError(ValueError):
    """The client's input is wrong (the service answers INVALID_ARGUMENT with the message). Only these
    become INVALID_ARGUMENT: any other exception is a fault of ours, INTERNAL and logged."""


def invalid_argument(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, message)


def resource_exhausted(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)
