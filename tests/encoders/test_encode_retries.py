"""The decoder's retries of a refused Encode: a full cache (RESOURCE_EXHAUSTED) is retried with jittered
pauses under a doubling bound, for the full-cache wait at most; no encoder is needed (a fake stub and a
fake clock)."""

from __future__ import annotations

import grpc
import pytest

from common.pb import common_pb2
from decoder_svc.encoders import remote_source
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource, RetryPolicy
from decoder_svc.engine.embedding_source import EmbeddingRequest


class _Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "embedding cache full"


class _FullCacheStub:
    def __init__(self) -> None:
        self.calls = 0

    def Encode(self, request, **kwargs):  # noqa: N802 - the gRPC method's name
        self.calls += 1
        raise _Refused()


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
            source._call_encode("127.0.0.1:1", req, common_pb2.ImageInput(content_hash="ab" * 32), [],
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
