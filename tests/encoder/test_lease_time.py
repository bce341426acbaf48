"""A lease's time covers the Encode it answers (issue 63): the encoder counts it from the Encode's
arrival, so an Encode that ran longer than the TTL answers with a lease the decoder can still prove
held (it bounds a lease by the moment it sent the ask). The cache's clock is moved by the test, not
timed: each reading of it moves it on."""

from __future__ import annotations

import threading

from common.pb import common_pb2
from tests.encoder.conftest import encode_request, image_bytes

STEP_S = 100.0  # each reading of the cache's clock: far more than the fixture's 30 s TTL


class _SteppingClock:
    def __init__(self) -> None:
        self.now = 5000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.now += STEP_S
            return self.now


def test_a_lease_answered_after_a_long_encode_counts_from_its_arrival(encoder, monkeypatch):
    cache = encoder.servicer.cache
    monkeypatch.setattr(cache, "_clock", _SteppingClock())
    response = encoder.stub.Encode(encode_request(image_bytes(6301), accept=(common_pb2.TRANSPORT_SHM,)),
                                   timeout=60)
    (ref,) = response.embeddings
    assert ref.lease_id
    # Granted at least one reading (STEP_S) after the Encode arrived: its time runs TTL past the grant.
    assert ref.lease_expires_in_s >= cache.lease_ttl_s + STEP_S, ref.lease_expires_in_s
    encoder.release_all(response)

