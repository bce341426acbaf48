"""An encoder decoding in worker processes (--decode-processes) answers exactly as one decoding in
threads: the same content hashes and embeddings; a bad image fails only its own request with
INVALID_ARGUMENT; a decode process that dies fails its request with UNAVAILABLE and the next is served."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.hashing import hash_image_file
from common.pb import common_pb2
from encoder_svc.server import EncoderConfig
from tests.encoder.conftest import EncoderHarness, encode_request, image_bytes

INLINE = common_pb2.TRANSPORT_INLINE
IMAGES = [image_bytes(100 + i, size=(30 + i, 20 + 2 * i), fmt="PNG" if i % 2 else "JPEG") for i in range(5)]


def _harness(model_dir, processes: int, pool_always: bool = True) -> EncoderHarness:
    return EncoderHarness(EncoderConfig(model=model_dir, cache_bytes=1 << 20, lease_ttl_s=30,
                                        decode_processes=processes, pool_decode_always=pool_always))


@pytest.fixture(scope="module")
def pooled(tiny_model_dir):
    """Every image through the processes (--pool-decode-always: these tests are about the pool)."""
    harness = _harness(tiny_model_dir, 2)
    yield harness
    harness.close()


def test_a_lone_image_decodes_in_a_thread_and_concurrent_ones_in_the_pool(tiny_model_dir):
    """By default the one request decoding right now skips the process hop; while it decodes, another
    goes to the pool."""
    harness = _harness(tiny_model_dir, 2, pool_always=False)
    servicer, pool = harness.servicer, harness.servicer.decode_pool
    in_thread, release = threading.Event(), threading.Event()
    pooled_calls = []
    real_thread, real_pool = servicer._decode_all, pool.decode

    def held_thread_decode(*args):
        in_thread.set()
        assert release.wait(30)
        return real_thread(*args)

    async def counted_pool_decode(*args, **kwargs):
        pooled_calls.append(1)
        return await real_pool(*args, **kwargs)

    servicer._decode_all, pool.decode = held_thread_decode, counted_pool_decode
    try:
        with ThreadPoolExecutor(1) as background:
            first = background.submit(_encode, harness, IMAGES[0])
            assert in_thread.wait(30)  # the lone request is decoding in a thread
            _encode(harness, IMAGES[1])  # meanwhile: through the pool
            assert pooled_calls == [1]
            release.set()
            first.result(timeout=60)
        assert pooled_calls == [1]
    finally:
        release.set()
        servicer._decode_all, pool.decode = real_thread, real_pool
        harness.close()


def _encode(harness: EncoderHarness, *images: bytes, salt: str = ""):
    return harness.stub.Encode(encode_request(*images, accept=[INLINE], cache_salt=salt), timeout=60)


def test_processes_and_threads_give_the_same_hashes_and_embeddings(pooled, tiny_model_dir):
    assert pooled.servicer.decode_pool is not None and pooled.servicer.decode_pool.processes == 2
    threaded = _harness(tiny_model_dir, 0)
    try:
        assert threaded.servicer.decode_pool is None
        from_pool = _encode(pooled, *IMAGES[:4], salt="tenant").embeddings
        from_threads = _encode(threaded, *IMAGES[:4], salt="tenant").embeddings
    finally:
        threaded.close()
    fingerprint = pooled.servicer.vision.fingerprint
    for data, a, b in zip(IMAGES, from_pool, from_threads, strict=False):
        assert a.content_hash == b.content_hash == hash_image_file(data, fingerprint, "tenant")
        assert a.inline_data == b.inline_data and len(a.inline_data) == a.nbytes > 0


def test_every_pixel_slot_comes_back(pooled):
    """Misses (read by the worker), hits, a joined production and failed requests all give their
    images' slots back to the decode pool."""
    fresh = [image_bytes(300 + i, size=(25 + i, 19)) for i in range(6)]
    _encode(pooled, *fresh[:3], salt="slots")
    _encode(pooled, *fresh[:3], salt="slots")  # hits
    with pytest.raises(grpc.RpcError):
        _encode(pooled, fresh[3], fresh[4], b"broken", salt="slots")
    _encode(pooled, fresh[5], fresh[5], salt="slots")  # one production, joined by its twin
    decoder = pooled.servicer.decode_pool
    deadline = time.monotonic() + 60
    while sorted(decoder._free) != list(range(decoder.slots)):  # the worker's threads release theirs
        assert time.monotonic() < deadline, f"slots never came back: {decoder._free}"
        time.sleep(0.05)


def test_a_bad_image_fails_only_its_request(pooled):
    truncated = IMAGES[1][:80]
    with pytest.raises(grpc.RpcError) as err:
        _encode(pooled, IMAGES[0], truncated)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "image 1" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        _encode(pooled, b"not an image at all")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "image 0" in err.value.details()
    assert len(_encode(pooled, IMAGES[2]).embeddings) == 1  # still serving
    assert pooled.stats().active_leases == 0


def test_a_decode_process_dying_mid_request_is_unavailable_then_served(pooled):
    decoder = pooled.servicer.decode_pool
    restarts = decoder.restarts

    async def die(data, fingerprint, salt, in_slot=False):  # this image kills its decode process
        return await decoder.run(os._exit, 7)

    decoder.decode, real = die, decoder.decode
    try:
        with pytest.raises(grpc.RpcError) as err:
            _encode(pooled, IMAGES[3])
    finally:
        decoder.decode = real
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode process died" in err.value.details()
    assert decoder.restarts == restarts + 1
    stats = pooled.servicer.stats()  # (not in the proto: /metrics and the log line)
    assert stats.decode_restarts == restarts + 1 and stats.decode_processes == 2
    assert _encode(pooled, IMAGES[3], salt="after-death").embeddings[0].content_hash
    assert pooled.stats().active_leases == 0


def test_decode_processes_killed_while_idle(pooled):
    decoder = pooled.servicer.decode_pool
    old, restarts = decoder.pids, decoder.restarts
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while decoder.restarts < restarts + len(old):  # noticed on the server's event loop
        assert time.monotonic() < deadline, "the pool never noticed its dead processes"
        time.sleep(0.05)
    # No request was decoding: the next one is served by the new processes.
    assert len(_encode(pooled, IMAGES[4], salt="after-kill").embeddings) == 1
    assert not set(decoder.pids) & set(old)
