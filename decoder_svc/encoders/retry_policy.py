"""How long the decoder keeps asking an encoder for an image, and the errors that end the asking.

Which gRPC codes are worth another try, which are the link's (their details name addresses and stay in
the log), and the exceptions the fetch turns into an image's failure code.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED}
# Errors of the link, not of the encoder's judgement: their details name addresses.
TRANSPORT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
                   grpc.StatusCode.CANCELLED}
# How an image's failure of these codes begins: the stage that failed, which the gateway names to the client
# (gateway/errors.py passes such a message on rather than its fixed text for the code).
ENCODER_STAGE = "vision encoder"
STAGE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
PROBE_TIMEOUT_S = 2.0  # a stats call to an encoder that is alive takes milliseconds, however busy it is


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying an encoder before failing the image.

    total_timeout_s runs from the image's first ask, whatever happens after (a wait for a fetch worker,
    the hash-first call, the call with bytes, retries), so an outage fails every image within it. A cache
    full of leased entries (RESOURCE_EXHAUSTED) is retried for full_cache_wait_s at most, then fails.
    The pause before each retry is drawn at random below a bound that doubles from initial_backoff_s up
    to max_backoff_s ("full jitter"), so images refused together retry apart.
    """

    attempt_timeout_s: float = 10.0  # waiting for an answer before asking whether the encoder is alive
    total_timeout_s: float = 20.0  # an encoder that never shows it is alive fails the image then
    busy_timeout_s: float = 300.0  # an encoder that is alive but busy with the image fails it then
    full_cache_wait_s: float = 2.0
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def busy_deadline(self, reach_deadline: float) -> float:
        """The busy deadline of an image whose first ask's reach deadline (total_timeout_s from it) is
        `reach_deadline`: busy_timeout_s from that first ask."""
        return reach_deadline - self.total_timeout_s + self.busy_timeout_s

    def renewed_deadline(self, now: float, busy_until: float) -> float:
        """The reach deadline of a new ask of an image at `now`, after an answer that could not be used
        (its lease may have lapsed): total_timeout_s of its own, never past the image's busy deadline."""
        return min(now + self.total_timeout_s, busy_until)

    def out_of_time_message(self) -> str:
        """The error of an image whose encoder answered too late for the answer to be used (its lease
        may have lapsed) and whose time ran out before it could be asked again."""
        return (f"the encoder answered too late for its answer to be used and this input's time "
                f"({self.busy_timeout_s:.0f} s) ran out before it could be asked again "
                f"(slow, not unreachable)")

    def busy_message(self) -> str:
        """The error of an image its encoder was still working on at busy_timeout_s."""
        return (f"the encoder was busy and had not finished this input within "
                f"{self.busy_timeout_s:.0f} s (it answered throughout: slow, not unreachable)")


class EncoderUnavailableError(RuntimeError):
    """The encoder could not be reached within the retry policy."""


class EncoderBusyError(RuntimeError):
    """The encoder was alive but had not finished the image within the policy's busy_timeout_s, or the
    image's time ran out before an ask could be sent: DEADLINE_EXCEEDED, never "unreachable"."""


class Released(Exception):  # noqa: N818 - not an error: nobody waits for the image any more
    """The image's slot was released while its Encode was in flight: the call was cancelled."""


class Unresponsive(grpc.RpcError):
    """An Encode without an answer from an encoder that did not answer a stats call either: unreachable."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the encoder answers no call"


class EncoderLeftRing(Exception):  # noqa: N818 - a redirection, not an error
    """The encoder being asked is no longer the image's owner (it left the ring); `owner` is."""

    def __init__(self, owner: str) -> None:
        super().__init__(owner)
        self.owner = owner
