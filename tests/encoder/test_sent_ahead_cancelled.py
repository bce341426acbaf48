"""After a cancelled request nothing runs on its behalf (issue 63): a file its decoder sent ahead
(Prefetch, needed_now) is produced for that request only, so once the request's Encode is cancelled (the
client hung up) and nobody else waits, the vision tower never runs it. Seen through the RPCs: the
encoder's `encodes` count and Lookup. The tower is held on a gate while the calls are made, so the
order of events is fixed by counts, not by timing."""

from __future__ import annotations

import threading
import time

from common.hashing import hash_image_file
from common.pb import common_pb2, encoder_pb2
from tests.encoder.conftest import encode_request, image_bytes

BOUND_S = 30.0  # bounds waits for what takes milliseconds; nothing is timed


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


def test_a_file_sent_ahead_for_a_cancelled_request_is_never_encoded(encoder, monkeypatch):
    servicer = encoder.servicer
    cache, vision = servicer.cache, servicer.worker.vision
    entered, gate = threading.Event(), threading.Event()
    encode_prepared = vision.encode_prepared

    def gated(*args, **kwargs):
        entered.set()
        assert gate.wait(BOUND_S)
        return encode_prepared(*args, **kwargs)

    monkeypatch.setattr(vision, "encode_prepared", gated)
    encodes = encoder.stats().encodes
    other = encoder.stub.Encode.future(encode_request(image_bytes(6401)), timeout=60)  # another tenant's
    try:
        assert entered.wait(BOUND_S), "the tower never took the other image"
        data, salt = image_bytes(6402), "sent-ahead-cancelled"
        key = hash_image_file(data, vision.fingerprint, salt)
        assert encoder.stub.Prefetch(encoder_pb2.PrefetchRequest(
            images=[common_pb2.ImageInput(data=data)], cache_salt=salt, needed_now=True),
            timeout=30).accepted == 1
        joined = cache.inflight_dedups
        ask = encoder.stub.Encode.future(encoder_pb2.EncodeRequest(
            images=[common_pb2.ImageInput(content_hash=key)], cache_salt=salt, lease_owner="decoder-1",
            request_id="r1#0", accept=[common_pb2.TRANSPORT_SHM]), timeout=60)
        _until(lambda: cache.inflight_dedups > joined, "the request's Encode joined the production")
        abandoned = cache.abandoned
        ask.cancel()  # the request ended: its decoder cancels the Encode
        _until(lambda: cache.waiters(key) == 0, "the cancelled Encode left the production")
    finally:
        gate.set()
    encoder.release_all(other.result(BOUND_S))
    _until(lambda: cache.abandoned > abandoned, "the worker dropped the production nobody waits for")
    assert encoder.stats().encodes == encodes + 1, "the tower ran for a request that had ended"
    assert not encoder.stub.Lookup(encoder_pb2.LookupRequest(content_hashes=[key], cache_salt=salt),
                                   timeout=10).cached[0]
