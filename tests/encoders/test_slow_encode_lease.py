"""An Encode slower than the lease time (issue 63): its answer is not thrown away for a deadline that
passed while the encoder worked, and the error of one whose time ran out says so.

A real gRPC server on 127.0.0.1 plays the encoder. Time is the source's clock, moved by a given number of
seconds once the first answer is in (as if that Encode had taken them: a slow tower), before the source
checks its lease: nothing is timed, and the source cannot see the time move before the answer comes.
- The encoder counts a lease's time from the Encode's arrival: a ref answered after a long Encode
  carries that time, and the decoder keeps its rows.
- A decoder that cannot prove the lease held (an encoder counting from the grant) asks again with a
  reach deadline of its own (the first ask's passed while the encoder worked): READY, not UNAVAILABLE.
- An image whose busy deadline passed meanwhile fails DEADLINE_EXCEEDED, never "unreachable"."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

from common.pb import common_pb2, encoder_pb2, encoder_pb2_grpc
from decoder_svc.encoders import remote_source
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource, RetryPolicy
from decoder_svc.encoders.retry_policy import ENCODER_STAGE
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingState

HASH = "cd" * 32
BOUND_S = 30.0  # bounds waits for what takes milliseconds; no test measures it
TTL_S = 60.0
POLICY = RetryPolicy(attempt_timeout_s=BOUND_S, total_timeout_s=2.5, busy_timeout_s=300.0,
                     initial_backoff_s=0.01, max_backoff_s=0.02)
ROWS = np.arange(12, dtype=np.float32).reshape(3, 4)


class _Clock:
    """The source's `time`: moved only by the fake encoder (and by what the source sleeps)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
        self.advance(seconds)


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(remote_source, "time", clock)
    return clock


class _SlowEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    """Its first Encode takes `first_s` seconds; every answer carries a lease whose time is `counted`
    from the grant ("grant": the TTL alone) or from the Encode's arrival ("ask")."""

    def __init__(self, first_s: float, counted: str) -> None:
        self.first_s, self.counted = first_s, counted
        self.encodes = self.releases = 0

    def Encode(self, request, context):  # noqa: N802 - the gRPC method's name
        self.encodes += 1
        took = self.first_s if self.encodes == 1 else 0.0
        expires_in = TTL_S + (took if self.counted == "ask" else 0.0)
        return encoder_pb2.EncodeResponse(embeddings=[common_pb2.EmbeddingRef(
            content_hash=HASH, shape=[3, 4], dtype=common_pb2.DTYPE_FLOAT32, nbytes=48,
            lease_id=f"lease-{self.encodes}", lease_expires_in_s=expires_in, inline_data=ROWS.tobytes())])

    def Release(self, request, context):  # noqa: N802
        self.releases += 1
        return encoder_pb2.ReleaseResponse(released=len(request.lease_ids))


@pytest.fixture
def serve():
    servers = []

    def start(encoder) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        encoder_pb2_grpc.add_EncoderServiceServicer_to_server(encoder, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def _fetch(address: str, clock: _Clock, first_s: float) -> tuple[EmbeddingState, str | None, str]:
    source = RemoteEmbeddingSource([address], retry=POLICY, transports=[common_pb2.TRANSPORT_INLINE])
    copy_out, copies = source._copy_out, []

    def late_copy(ref, encoder):  # the first answer is read first_s after its Encode was sent
        copies.append(ref.lease_id)
        clock.advance(first_s if len(copies) == 1 else 0.0)
        return copy_out(ref, encoder)

    source._copy_out = late_copy
    try:
        source.request(EmbeddingRequest("r1", HASH, None))
        deadline = time.monotonic() + BOUND_S
        while source.poll("r1", HASH) == EmbeddingState.PENDING:
            assert time.monotonic() < deadline, "the image neither arrived nor failed"
            time.sleep(0.01)
        state, error = source.poll("r1", HASH), source.error("r1", HASH)
        if state == EmbeddingState.READY:
            assert source.get("r1", HASH).numpy().tolist() == ROWS.tolist()
        return state, source.pop_error_code("r1"), error
    finally:
        source.close()


def test_a_lease_counted_from_the_ask_keeps_a_slow_encodes_answer(serve, clock):
    encoder = _SlowEncoder(first_s=2 * TTL_S, counted="ask")
    state, code, error = _fetch(serve(encoder), clock, encoder.first_s)
    assert state == EmbeddingState.READY, (code, error)
    assert encoder.encodes == 1  # the answer was used: the tower's work was not asked for twice


def test_an_answer_too_late_for_its_lease_is_asked_for_again_with_a_deadline_of_its_own(serve, clock):
    # 120 s of Encode: past the first ask's reach deadline (2.5 s) and the lease as the decoder can bound
    # it, within the image's busy deadline (300 s). The second ask (a cache hit) is answered at once.
    encoder = _SlowEncoder(first_s=2 * TTL_S, counted="grant")
    state, code, error = _fetch(serve(encoder), clock, encoder.first_s)
    assert state == EmbeddingState.READY, f"the retry reused a deadline already past: {code} {error}"
    assert encoder.encodes == 2


def test_an_image_out_of_time_after_a_late_answer_is_deadline_exceeded_not_unreachable(serve, clock):
    encoder = _SlowEncoder(first_s=POLICY.busy_timeout_s + 10, counted="grant")
    state, code, error = _fetch(serve(encoder), clock, encoder.first_s)
    assert state == EmbeddingState.FAILED and code == "DEADLINE_EXCEEDED", (code, error)
    assert "unreachable" not in error.split("(")[0] and "too late" in error
    assert error.startswith(ENCODER_STAGE)  # the gateway names the stage to the client (its 504)
    assert encoder.encodes == 1
