"""A request whose decoder went away before anything of it reached the client is started again on another
decoder (issue 67), so that a killed or drained decoder costs the client nothing it could see.

Only while nothing has been sent: a whole (not streamed) response before it is written, a stream before
its status line (its calls are started, and their first messages read, before the response begins). Only
for failures that say the decoder or the link to it went away (`decoder_went_away`), never for what the
decoder found in the request (INVALID_ARGUMENT), a client-facing refusal (RESOURCE_EXHAUSTED), or the
request's own deadline (DEADLINE_EXCEEDED). The calls start again with the same GenerateRequests (the
same seed, `n` and request id), within what is left of the request's deadline, on a decoder not tried
yet, at most `retries` times, and only while one of those is healthy; otherwise the error stands (a 503
with Retry-After for UNAVAILABLE, as before).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from common.pb import decoder_pb2
from gateway.balancer import DecoderEndpoint, DecoderPool, GenerationGroup
from gateway.errors import names_a_stage

log = logging.getLogger("mmserve.gateway")
_WENT_AWAY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
# Transport words of a broken connection, whatever code the client library gave it (INTERNAL, UNKNOWN).
_BROKEN_LINK_WORDS = ("socket closed", "connection reset", "stream removed", "rst_stream", "broken pipe")
_TRANSPORT_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


def decoder_went_away(exc: grpc.aio.AioRpcError) -> bool:
    """Whether exc says the decoder (or the connection to it) went away rather than that the request failed
    there: UNAVAILABLE, CANCELLED by the peer (the gateway's own cancels end its calls with
    asyncio.CancelledError, not an RpcError), or a broken connection. A live decoder's UNAVAILABLE that
    names the stage that failed (an image's encoder) is the request's failure, not the decoder's."""
    code, details = exc.code(), exc.details() or ""
    if names_a_stage(details):
        return False
    if code in _WENT_AWAY_CODES:
        return True
    return code in _TRANSPORT_CODES and any(word in details.lower() for word in _BROKEN_LINK_WORDS)


@dataclass
class DecoderAttempts:
    """A request's decoder calls (one per prompt, each for `n` samples) and the decoders they were tried
    on: started on one, and started again on another when that one went away before anything reached
    the client."""

    pool: DecoderPool
    requests: Sequence[decoder_pb2.GenerateRequest]
    request_id: str
    user: str = ""
    timeout_s: float | None = None  # the request's deadline, from its start; a retry gets what remains
    retries: int = 1  # most restarts on another decoder
    on_retry: Callable[[], None] | None = None  # counts each restart (the gateway's metrics)
    started_at: float = field(default_factory=time.monotonic)
    tried: list[DecoderEndpoint] = field(default_factory=list)  # every decoder a call was sent to
    retried: int = 0

    def remaining_s(self) -> float | None:
        """What is left of the deadline (None: no deadline)."""
        if self.timeout_s is None:
            return None
        return self.timeout_s - (time.monotonic() - self.started_at)

    async def start(self) -> GenerationGroup:
        """The calls started on a decoder not tried yet, their first messages in; a decoder that goes away
        while they start is replaced (may_retry), else its error is raised."""
        while True:
            try:
                return await self.pool.generate_group(self.requests, self.remaining_s(), self.request_id,
                                                      self.user, tried=self.tried)
            except grpc.aio.AioRpcError as exc:
                if not self.may_retry(exc):
                    raise
                self._count(exc)

    async def again(self, exc: grpc.aio.AioRpcError) -> GenerationGroup | None:
        """The calls started again elsewhere after exc ended them on the last decoder tried, with nothing
        sent to the client; None when exc or the state of things allows no retry (the caller raises it)."""
        if not self.may_retry(exc):
            return None
        self._count(exc)
        return await self.start()

    def may_retry(self, exc: grpc.aio.AioRpcError) -> bool:
        """Whether exc, which ended the calls on the last decoder tried, is worth a restart: the decoder
        went away, retries and deadline are left, and another decoder not tried yet is healthy. A decoder
        that went away is marked down until the next health round either way."""
        if not decoder_went_away(exc):
            return False
        if self.tried:
            self.tried[-1].status = "UNREACHABLE"
        remaining = self.remaining_s()
        if self.retried >= self.retries or (remaining is not None and remaining <= 0):
            return False
        return any(e.usable and e not in self.tried for e in self.pool.endpoints)

    def _count(self, exc: grpc.aio.AioRpcError) -> None:
        self.retried += 1
        gone = self.tried[-1].address if self.tried else "?"
        log.warning("request %s: decoder %s went away before anything was sent (%s: %s); starting it "
                    "again on another decoder", self.request_id, gone, exc.code().name, exc.details())
        if self.on_retry is not None:
            self.on_retry()
