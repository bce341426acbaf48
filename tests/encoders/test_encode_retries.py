"""The decoder's retries of a refused Encode: a full cache (RESOURCE_EXHAUSTED) is retried with jittered
pauses under a doubling bound, for the full-cache wait at most; each attempt's timeout is cut to what is
left of the image's deadline. No encoder is needed (a fake stub and a fake clock)."""

from __future__ import annotations

import grpc
import pytest

from common.pb import encoder_pb2
from decoder_svc.encoders import remote_source
from decoder_svc.encoders.encode_items import by_hash
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource, RetryPolicy
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingState
from tests.encoders.fake_calls import FakeMethod


class _Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "embedding cache full"


class _FullCacheStub:
    def __init__(self) -> None:
        self.calls = 0
        self.Encode = FakeMethod(self._encode)
        # asked with no slot (the test calls the fetch directly): the source gives the ask's leases back
        self.Release = FakeMethod(lambda request, **kwargs: encoder_pb2.ReleaseResponse())

    def _encode(self, request, **kwargs):
        self.calls += 1
        raise _Refused()


class _Hung(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


class _HungCall:
    """An Encode that never answers: each wait for it uses up its whole timeout on the fake clock."""

    def __init__(self, stub: _HungStub) -> None:
        self.stub = stub

    def result(self, timeout=None):
        assert timeout is not None  # a wait without a timeout could hang the fetch worker forever
        self.stub.timeouts.append(timeout)
        self.stub.clock.now += timeout
        raise grpc.FutureTimeoutError()

    def cancel(self) -> bool:
        self.stub.cancelled += 1
        return True


class _HungStub:
    """An encoder that never answers, nor its stats (a stopped process): the source's every wait for an
    Encode is recorded, each uses up its timeout, and each unanswered Encode is cancelled."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.timeouts: list[float] = []
        self.cancelled = 0
        self.Encode = FakeMethod(None)
        self.Encode.future = self._start
        # the asks it never answered are given back by name (their answers may be lost on the way): a
        # stopped encoder does not answer that either
        self.released_asks: list[str] = []
        self.Release = FakeMethod(self._release)

    def _release(self, request, **kwargs):
        self.released_asks.extend(request.request_ids)
        raise _Hung()

    def _start(self, request, timeout=None, **kwargs) -> _HungCall:
        assert timeout is not None  # an Encode without a timeout could hang forever
        return _HungCall(self)

    def GetStats(self, request, **kwargs):  # noqa: N802 - the gRPC method's name
        raise _Hung()


class _Clock:
    """time.monotonic and time.sleep of the module under test: sleeping advances the clock."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.pauses: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def _refused_pauses(monkeypatch, seed: int) -> tuple[list[float], int]:
    import random

    clock = _Clock()
    monkeypatch.setattr(remote_source, "time", clock)
    random.seed(seed)
    policy = RetryPolicy()
    source = RemoteEmbeddingSource(["127.0.0.1:1"], retry=policy)
    stub = _FullCacheStub()
    monkeypatch.setattr(source, "_stub", lambda encoder: stub)
    req = EmbeddingRequest("r1", "ab" * 32, None)
    try:
        with pytest.raises(grpc.RpcError):
            source._call_encode("127.0.0.1:1", req, by_hash(req), [],
                                deadline=clock.now + policy.total_timeout_s)
    finally:
        source.close()
    return clock.pauses, stub.calls


def test_full_cache_retries_are_jittered_and_bounded(monkeypatch):
    policy = RetryPolicy()
    runs = [_refused_pauses(monkeypatch, seed) for seed in range(5)]
    for pauses, calls in runs:
        assert calls == len(pauses) + 1
        bound = policy.initial_backoff_s
        for pause in pauses:  # each pause at random below a doubling bound
            assert 0.0 <= pause <= bound
            bound = min(policy.max_backoff_s, 2 * bound)
        assert sum(pauses) <= policy.full_cache_wait_s  # then the refusal goes to the caller
    # Callers refused together do not come back together: their pauses differ.
    firsts = {round(pauses[0], 6) for pauses, _ in runs}
    assert len(firsts) == len(runs)


def test_each_attempt_timeout_is_cut_to_what_is_left_of_the_images_deadline(monkeypatch):
    """The image's deadline starts at its ask, not when a fetch worker takes it up: an image that waited
    4.5 s for a worker has 5.5 s left of 10, so its attempts get 3 s and then only the 2.5 s left (a full
    3 s, or a deadline restarted by the worker, would end past the image's deadline)."""
    clock = _Clock()
    monkeypatch.setattr(remote_source, "time", clock)
    monkeypatch.setattr(remote_source.random, "uniform", lambda lo, hi: 0.0)  # no pauses: exact sums
    policy = RetryPolicy(attempt_timeout_s=3.0, total_timeout_s=10.0)
    source = RemoteEmbeddingSource(["127.0.0.1:1"], retry=policy)
    stub = _HungStub(clock)
    monkeypatch.setattr(source, "_stub", lambda encoder: stub)
    queued: list = []  # the fetch, held back from the worker pool so the test decides when it runs
    monkeypatch.setattr(source._pool, "submit", lambda fn, *args: queued.append((fn, args)))
    try:
        asked_at = clock.now
        source.request(EmbeddingRequest("r1", "cd" * 32, None))
        clock.now += 4.5  # every fetch worker was busy
        fn, args = queued.pop()
        fn(*args)
        assert stub.timeouts == pytest.approx([3.0, 2.5]) and stub.cancelled == 2
        assert clock.now == pytest.approx(asked_at + policy.total_timeout_s)  # failed on time, not later
        assert source.poll("r1", "cd" * 32) == EmbeddingState.FAILED
        assert "unreachable" in source.error("r1", "cd" * 32)
    finally:
        source.close()


def test_a_full_cache_at_the_images_deadline_is_busy_not_unreachable(monkeypatch):
    """An encoder that answers RESOURCE_EXHAUSTED (its cache full of leased entries) until the image's
    deadline is busy, not down: the image fails RESOURCE_EXHAUSTED with the encoder's own words (429 at the
    gateway), never "encoder unreachable after 1 attempts (RESOURCE_EXHAUSTED)" with UNAVAILABLE."""
    clock = _Clock()
    monkeypatch.setattr(remote_source, "time", clock)
    policy = RetryPolicy(total_timeout_s=0.5, full_cache_wait_s=5.0)  # the deadline comes first
    source = RemoteEmbeddingSource(["127.0.0.1:1"], retry=policy)
    stub = _FullCacheStub()
    monkeypatch.setattr(source, "_stub", lambda encoder: stub)
    queued: list = []
    monkeypatch.setattr(source._pool, "submit", lambda fn, *args: queued.append((fn, args)))
    try:
        source.request(EmbeddingRequest("r1", "ef" * 32, None))
        fn, args = queued.pop()
        fn(*args)
        assert stub.calls >= 1
        assert source.poll("r1", "ef" * 32) == EmbeddingState.FAILED
        error = source.error("r1", "ef" * 32)
        assert source.pop_error_code("r1") == "RESOURCE_EXHAUSTED"
        assert "unreachable" not in error and "embedding cache full" in error
    finally:
        source.close()
