"""A busy encoder is not an unreachable one (issue 38, item 5): the decoder keeps an Encode open past its
attempt timeout, and past the unreachable-encoder deadline, while the encoder answers stats calls, and
gets the embedding from that one call; an encoder busy past `busy_timeout_s` fails the image with
DEADLINE_EXCEEDED ("busy"), not UNAVAILABLE. A real gRPC server on 127.0.0.1 plays the encoder; its
Encode answers only after a number of stats calls, so the waits are counted, not timed: the source's
deadlines run on a clock that moves one attempt timeout at each stats call the encoder answers (a busy
wait), and not at all otherwise, so a loaded machine cannot make the encoder look unreachable."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from common.pb import common_pb2, encoder_pb2, encoder_pb2_grpc
from decoder_svc.encoders import remote_source
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource, RetryPolicy
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingState

HASH = "ab" * 32
BOUND_S = 30.0  # bounds waits for what takes milliseconds; no test measures it
ATTEMPT_S = 1.0  # also the stats call's timeout: ample for a loopback call on a loaded machine
# An unreachable deadline of 2.5 attempts: an encoder that needs three stats calls before it answers is
# busy for longer (on the source's clock, _Clock) than an unreachable one is waited for.
POLICY = RetryPolicy(attempt_timeout_s=ATTEMPT_S, total_timeout_s=2.5 * ATTEMPT_S, busy_timeout_s=BOUND_S,
                     initial_backoff_s=0.01, max_backoff_s=0.02)


class _Clock:
    """The source's `time`: monotonic time that moves `step` (ATTEMPT_S unless a test says) at each stats
    call answered (`tick`) and by what the source sleeps; the waits themselves are real (gRPC's)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.step = ATTEMPT_S
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self.now

    def tick(self) -> None:
        with self._lock:
            self.now += self.step

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
        with self._lock:
            self.now += seconds


@pytest.fixture(autouse=True)
def clock(monkeypatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(remote_source, "time", clock)
    return clock


class _BusyEncoder(encoder_pb2_grpc.EncoderServiceServicer):
    """Answers an Encode once it has been asked for its stats `probes` times (None: never)."""

    def __init__(self, probes: int | None, clock: _Clock | None = None) -> None:
        self.needed = probes
        self.clock = clock
        self.cond = threading.Condition()
        self.probes = self.encodes = self.abandoned = 0
        self.time_left_when_abandoned: list[float] = []  # of each abandoned call's own deadline, seconds
        self.released_asks: list[str] = []  # Release by the asks' names

    def Release(self, request, context):  # noqa: N802
        with self.cond:
            self.released_asks.extend(request.request_ids)
            self.cond.notify_all()
        return encoder_pb2.ReleaseResponse()

    def GetStats(self, request, context):  # noqa: N802 - the gRPC method's name
        with self.cond:
            self.probes += 1
            if self.clock is not None:
                self.clock.tick()  # a busy wait of one attempt has passed
            self.cond.notify_all()
        return encoder_pb2.EncoderStats()

    def _wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def Encode(self, request, context):  # noqa: N802
        context.add_callback(self._wake)  # the call ended (cancelled, or its deadline): stop waiting
        with self.cond:
            self.encodes += 1
            self.cond.notify_all()
            done = self.cond.wait_for(lambda: not context.is_active() or (
                self.needed is not None and self.probes >= self.needed), BOUND_S)
            if not done or not context.is_active():
                self.abandoned += 1
                self.time_left_when_abandoned.append(context.time_remaining() or 0.0)
                self.cond.notify_all()
                context.abort(grpc.StatusCode.CANCELLED, "the caller left")
        rows = b"\0" * 48
        return encoder_pb2.EncodeResponse(embeddings=[common_pb2.EmbeddingRef(
            content_hash=HASH, shape=[3, 4], dtype=common_pb2.DTYPE_FLOAT32, nbytes=48, inline_data=rows)])


@pytest.fixture
def serve():
    servers = []

    def start(encoder: _BusyEncoder) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        encoder_pb2_grpc.add_EncoderServiceServicer_to_server(encoder, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


def _fetch(address: str, policy: RetryPolicy = POLICY) -> tuple[EmbeddingState, str | None, str, int]:
    """(final state, error code, error text, busy waits) of one image asked of the encoder at address."""
    source = RemoteEmbeddingSource([address], retry=policy)
    try:
        source.request(EmbeddingRequest("r1", HASH, None))
        deadline = time.monotonic() + BOUND_S
        while source.poll("r1", HASH) == EmbeddingState.PENDING:
            assert time.monotonic() < deadline, "the image neither arrived nor failed"
            time.sleep(0.01)
        state, error = source.poll("r1", HASH), source.error("r1", HASH)
        return state, source.pop_error_code("r1"), error, source.stats().encoder_busy_waits
    finally:
        source.close()


def test_a_busy_encoder_is_waited_for_on_one_open_call(serve, clock):
    encoder = _BusyEncoder(probes=3, clock=clock)
    start = clock.monotonic()
    state, code, error, busy_waits = _fetch(serve(encoder))
    assert state == EmbeddingState.READY, f"a busy encoder was taken for an unreachable one: {code} {error}"
    assert encoder.encodes == 1 and encoder.probes == 3 and busy_waits == 3
    assert clock.monotonic() - start > POLICY.total_timeout_s  # open past the unreachable deadline


def test_an_encoder_busy_past_the_busy_timeout_is_deadline_exceeded(serve, clock):
    # Each busy wait moves the source's clock 10 s: the third passes the busy timeout of 25 s, long before
    # the Encode's own gRPC deadline (25 s of real time) could end it instead.
    clock.step = 10.0
    encoder = _BusyEncoder(probes=None, clock=clock)
    state, code, error, busy_waits = _fetch(serve(encoder), RetryPolicy(
        attempt_timeout_s=ATTEMPT_S, total_timeout_s=2.5 * ATTEMPT_S, busy_timeout_s=25.0,
        initial_backoff_s=0.01))
    assert state == EmbeddingState.FAILED and code == "DEADLINE_EXCEEDED", (code, error)
    assert "busy" in error and "unreachable" not in error.split("(")[0] and busy_waits == 3
    assert encoder.encodes == 1


def test_closing_the_source_cancels_a_call_to_a_busy_encoder(serve):
    """A decoder shutting down (SIGTERM: its engine core closes the source) does not wait for a busy
    encoder: the open Encode is cancelled, not left to run to its own deadline."""
    encoder = _BusyEncoder(probes=None)
    source = RemoteEmbeddingSource([serve(encoder)], retry=RetryPolicy(
        attempt_timeout_s=BOUND_S, total_timeout_s=BOUND_S, busy_timeout_s=2 * BOUND_S))
    source.request(EmbeddingRequest("r1", HASH, None))
    with encoder.cond:
        assert encoder.cond.wait_for(lambda: encoder.encodes == 1, BOUND_S)
    source.close()
    with encoder.cond:
        assert encoder.cond.wait_for(lambda: encoder.abandoned == 1, BOUND_S)
    assert encoder.time_left_when_abandoned[0] > BOUND_S, "the call ran into its deadline: never cancelled"


@pytest.mark.parametrize("tracked_late", [False, True])
def test_closing_the_source_gives_back_the_leases_of_the_asks_in_flight_by_name(serve, monkeypatch,
                                                                                 tracked_late):
    """An answer may cross the cancel at close (an engine core stopping, or whose front end died): the
    ask in flight is released by its name before the channels close, not left to the lease's TTL. Also
    when close comes after the encoder got the Encode and before the source tracked its call (a
    loaded machine's thread switch, held open here until close has run)."""
    if tracked_late:
        track, closed = RemoteEmbeddingSource._track, threading.Event()

        def late_track(self, call, key=None):
            closed.wait(BOUND_S)
            return track(self, call, key)

        release_now = RemoteEmbeddingSource._release_now

        def release_then_let_track(self, asks, timeout_s):
            release_now(self, asks, timeout_s)
            closed.set()

        monkeypatch.setattr(RemoteEmbeddingSource, "_track", late_track)
        monkeypatch.setattr(RemoteEmbeddingSource, "_release_now", release_then_let_track)
    encoder = _BusyEncoder(probes=None)
    source = RemoteEmbeddingSource([serve(encoder)], retry=RetryPolicy(
        attempt_timeout_s=BOUND_S, total_timeout_s=BOUND_S, busy_timeout_s=2 * BOUND_S))
    source.request(EmbeddingRequest("r1", HASH, None))
    with encoder.cond:
        assert encoder.cond.wait_for(lambda: encoder.encodes == 1, BOUND_S)
    source.close()
    assert len(encoder.released_asks) == 1 and encoder.released_asks[0].startswith("r1#")


def test_releasing_a_request_cancels_its_encode_in_flight(serve):
    """A request that ends (its client hung up) while its image is being encoded: the Encode is
    cancelled, so the encoder can stop work nobody waits for; nothing counts as failed."""
    encoder = _BusyEncoder(probes=None)
    source = RemoteEmbeddingSource([serve(encoder)], retry=RetryPolicy(
        attempt_timeout_s=BOUND_S, total_timeout_s=BOUND_S, busy_timeout_s=2 * BOUND_S))
    try:
        source.request(EmbeddingRequest("r1", HASH, None))
        with encoder.cond:
            assert encoder.cond.wait_for(lambda: encoder.encodes == 1, BOUND_S)
        source.release("r1")
        with encoder.cond:
            assert encoder.cond.wait_for(lambda: encoder.abandoned == 1, BOUND_S)
        assert encoder.time_left_when_abandoned[0] > BOUND_S, "never cancelled: it ran into its deadline"
        assert source.stats().embedding_failures == 0
    finally:
        source.close()
