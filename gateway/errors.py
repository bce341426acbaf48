"""Errors in OpenAI's shape, with HTTP statuses mapped from gRPC status codes (common/errors.py)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import grpc

from common.errors import HTTP_STATUS_OF_GRPC

# OpenAI's `error.type` for each status (what its own API and the SDKs' exception classes use).
ERROR_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
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
    retry_after_s: int | None = None  # sent as Retry-After (429 and 503: real overload, worth a retry)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def headers(self) -> dict[str, str]:
        """Retry-After, when the error is worth retrying."""
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}}, as OpenAI sends it."""
        return {"error": {"message": self.message,
                          "type": ERROR_TYPE_OF_STATUS.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


MAX_ECHOED_CHARS = 64  # of a name the client sent, quoted back in an error


def quoted(name: str, limit: int = MAX_ECHOED_CHARS) -> str:
    """A client's name as an error quotes it: its repr, cut to `limit` characters, so that a huge name
    makes a short error, never one over a message limit."""
    if len(name) <= limit:
        return repr(name)
    return f"{name[:limit]!r}... ({len(name)} characters)"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def http_status_of(code: grpc.StatusCode) -> int:
    """The HTTP status for a gRPC status code (500 for any code the mapping does not name)."""
    return HTTP_STATUS_OF_GRPC.get(code, 500)


log = logging.getLogger("mmserve.gateway")
# Addresses and transport words in gRPC details ("ipv4:10.0.0.5:50052", "[::1]:50052", "host:port").
_ADDRESS = re.compile(r"\b(?:ipv4|ipv6|unix|unix-abstract|dns):\S+|\[[0-9A-Fa-f:.]+\](?::\d+)?"
                      r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\b[\w.-]+:\d{2,5}\b")
# What the client is told for codes whose details come from the transport, not from the decoder's checks.
_GENERIC = {
    grpc.StatusCode.UNAVAILABLE: "no decoder is available now; retry later",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the decoder did not finish within the request timeout",
    grpc.StatusCode.UNAUTHENTICATED: "the decoder refused the gateway's credentials",
    grpc.StatusCode.PERMISSION_DENIED: "the decoder refused the gateway's credentials",
}
RETRY_AFTER_S = 1
# The decoder's own messages for those codes that name the stage that failed or took the time (an image's
# Encode: decoder_svc/encoders/retry_policy.py's ENCODER_STAGE): passed on, not replaced by the fixed text.
_STAGE_PREFIXES = ("vision encoder: ",)
# The decoder refusing the gateway's own credentials is the server's problem, not the client's: a 401
# would tell the client its API key is wrong. 502 Bad Gateway: an upstream refused the gateway.
_GATEWAY_CREDENTIALS = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
BAD_GATEWAY = 502


def names_a_stage(details: str) -> bool:
    """Whether a decoder's error details name the stage that failed (an image's Encode), i.e. come from a
    live decoder's own checks rather than from the transport."""
    return details.startswith(_STAGE_PREFIXES)


def scrub(details: str) -> str:
    """details without network addresses (they stay in the gateway's log)."""
    return _ADDRESS.sub("<address>", details)


def from_rpc_error(exc: grpc.RpcError) -> APIError:
    """An APIError for a failed DecoderService call; `code` carries the gRPC code's name, lowercase.

    The body never carries upstream addresses or transport messages: codes the transport produces get a
    fixed message, the decoder's own validation messages are passed on with any address removed, and
    a message too large for the gRPC limit is a 413, not a 429 that clients would retry. The decoder
    refusing the gateway's credentials (UNAUTHENTICATED, PERMISSION_DENIED) is a 502, not a 401 or 403
    that would blame the client's API key."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else str(exc)) or code.name
    status = BAD_GATEWAY if code in _GATEWAY_CREDENTIALS else http_status_of(code)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return APIError(413, "the request is larger than the decoder's message limit",
                        code="request_too_large")
    if (code in _GENERIC and not names_a_stage(details)) or status == 500:
        log.warning("decoder call failed: %s: %s", code.name, details)
        message = _GENERIC.get(code, "the decoder failed to process the request")
    else:
        message = scrub(details)
    retry = RETRY_AFTER_S if status in (429, 503) else None
    return APIError(status, message, code=code.name.lower(), retry_after_s=retry)
