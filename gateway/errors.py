"""Errors in OpenAI's shape, with HTTP statuses mapped from gRPC status codes (common/errors.py)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from common.errors import HTTP_STATUS_OF_GRPC

# OpenAI's `error.type` for each status (what its own API and the SDKs' exception classes use).
ERROR_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


@dataclass
class APIError(Exception):
    """A request that fails with an HTTP status and an OpenAI-shaped body."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}}, as OpenAI sends it."""
        return {"error": {"message": self.message,
                          "type": ERROR_TYPE_OF_STATUS.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def http_status_of(code: grpc.StatusCode) -> int:
    """The HTTP status for a gRPC status code (500 for any code the mapping does not name)."""
    return HTTP_STATUS_OF_GRPC.get(code, 500)


def from_rpc_error(exc: grpc.RpcError) -> APIError:
    """An APIError for a failed DecoderService call; `code` carries the gRPC code's name, lowercase."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return APIError(http_status_of(code), details or code.name, code=code.name.lower())
