"""A decoder failure that names the stage that took the time or failed (an image's Encode) reaches the
client as it is, with its HTTP status (504, 503), never as "no decoder is available" (issue 63); the
transport's own errors keep the gateway's fixed text."""

from __future__ import annotations

import grpc

from decoder_svc.encoders.retry_policy import ENCODER_STAGE, RetryPolicy
from gateway.errors import from_rpc_error


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_an_encode_past_its_deadline_is_a_504_naming_the_encoder():
    policy = RetryPolicy()
    for message in (policy.busy_message(), policy.out_of_time_message()):
        error = from_rpc_error(_Failed(grpc.StatusCode.DEADLINE_EXCEEDED, f"{ENCODER_STAGE}: {message}"))
        assert error.status == 504 and error.message.startswith(ENCODER_STAGE), error.message
        assert "decoder" not in error.message.split("(")[0]


def test_an_unreachable_encoder_is_a_503_that_says_so_without_its_address():
    error = from_rpc_error(_Failed(grpc.StatusCode.UNAVAILABLE,
                                   f"{ENCODER_STAGE}: encoder unreachable at 10.0.0.5:50052 (3 attempts)"))
    assert error.status == 503 and "no decoder" not in error.message and "10.0.0.5" not in error.message
    assert error.message.startswith(ENCODER_STAGE)


def test_the_transports_own_errors_keep_the_fixed_text():
    error = from_rpc_error(_Failed(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"))
    assert error.status == 503 and error.message == "no decoder is available now; retry later"
    error = from_rpc_error(_Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert error.status == 504 and "request timeout" in error.message
