"""A file sent ahead (a Prefetch with its bytes) and asked for by hash while it is still being decoded:
the ask waits for it instead of answering NOT_FOUND (encoder_svc/pending_files.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

import encoder_svc.server as server_module
from common.hashing import hash_image_file
from common.pb import common_pb2, encoder_pb2
from encoder_svc.pending_files import PendingFiles
from encoder_svc.server import EncoderConfig
from tests.encoder.conftest import EncoderHarness, image_bytes

GATE = threading.Event()  # the encoder's decodes wait for it: the test decides when a decode ends


@pytest.fixture
def slow_encoder(tiny_model_dir, monkeypatch):
    """An encoder decoding in threads, each decode held until GATE is set."""
    real = server_module.decode_and_hash

    def gated(*args, **kwargs):
        GATE.wait(30)
        return real(*args, **kwargs)

    GATE.clear()
    monkeypatch.setattr(server_module, "decode_and_hash", gated)
    harness = EncoderHarness(EncoderConfig(model=tiny_model_dir, cache_bytes=1 << 20, decode_processes=0))
    yield harness
    GATE.set()
    harness.close()


def _until_pending(encoder: EncoderHarness) -> None:
    """Wait until the encoder has registered a file as being decoded (the Prefetch arrived)."""
    deadline = time.monotonic() + 30
    while not len(encoder.servicer.pending):
        assert time.monotonic() < deadline, "the Prefetch never registered its file"
        time.sleep(0.01)


def _by_hash(key: str, salt: str) -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(images=[common_pb2.ImageInput(content_hash=key)], cache_salt=salt,
                                     accept=[common_pb2.TRANSPORT_INLINE])


def test_an_ask_by_hash_waits_for_the_file_being_decoded(slow_encoder):
    data = image_bytes(901)
    key = hash_image_file(data, slow_encoder.servicer.vision.fingerprint, "ahead")
    with pytest.raises(grpc.RpcError) as err:  # nothing sent ahead: NOT_FOUND at once
        slow_encoder.stub.Encode(_by_hash(key, "ahead"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    ahead = slow_encoder.stub.Prefetch.future(encoder_pb2.PrefetchRequest(
        images=[common_pb2.ImageInput(data=data)], cache_salt="ahead"), timeout=60)
    _until_pending(slow_encoder)  # the Prefetch is decoding now
    asked = slow_encoder.stub.Encode.future(_by_hash(key, "ahead"), timeout=60)
    threading.Timer(0.3, GATE.set).start()  # the decode ends while the ask waits (or before it arrives)
    reply = asked.result()
    assert reply.embeddings[0].content_hash == key and reply.embeddings[0].inline_data
    assert ahead.result().accepted == 1
    other_tenant = _by_hash(key, "someone-else")  # nothing of another salt: NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        slow_encoder.stub.Encode(other_tenant, timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(slow_encoder.servicer.pending) == 0


def test_a_file_that_fails_to_decode_releases_its_waiters(slow_encoder):
    bad = b"\x89PNG\r\n\x1a\n" + b"\0" * 64  # a PNG signature, then nothing valid
    key = hash_image_file(bad, slow_encoder.servicer.vision.fingerprint, "")
    ahead = slow_encoder.stub.Prefetch.future(encoder_pb2.PrefetchRequest(
        images=[common_pb2.ImageInput(data=bad)]), timeout=60)
    _until_pending(slow_encoder)
    asked = slow_encoder.stub.Encode.future(_by_hash(key, ""), timeout=60)
    threading.Timer(0.3, GATE.set).start()
    with pytest.raises(grpc.RpcError) as err:
        asked.result()
    assert err.value.code() == grpc.StatusCode.NOT_FOUND  # after the failed decode, not hanging
    with pytest.raises(grpc.RpcError):
        ahead.result()
    assert len(slow_encoder.servicer.pending) == 0


def test_pending_counts_each_registration_and_bounds_the_wait():
    async def run() -> None:
        pending = PendingFiles()
        first, second = pending.begin([("s", "k")]), pending.begin([("s", "k")])
        waiter = asyncio.ensure_future(pending.wait([("s", "k")], timeout=5))
        pending.end(first)
        await asyncio.sleep(0.01)
        assert not waiter.done()  # one registration still holds it
        pending.end(second)
        await asyncio.wait_for(waiter, 1)
        pending.end(second)  # emptied: idempotent
        held = pending.begin([("s", "k2")])
        await asyncio.wait_for(pending.wait([("s", "k2")], timeout=0.05), 30)  # bounded by its timeout
        pending.end(held)
        assert len(pending) == 0

    asyncio.run(run())


def _until_awaited(encoder: EncoderHarness) -> None:
    """Wait until an ask by hash is waiting for its file to arrive."""
    deadline = time.monotonic() + 30
    while not encoder.servicer.pending._arrivals:
        assert time.monotonic() < deadline, "the ask never waited for its file"
        time.sleep(0.01)


def test_an_ask_that_overtakes_the_file_sent_ahead_waits_for_it(slow_encoder):
    """The engine's small ask by hash can reach the encoder before the front end's megabytes do: with
    await_file_ms it waits for the file instead of answering NOT_FOUND (which would cost a resend)."""
    data = image_bytes(903)
    key = hash_image_file(data, slow_encoder.servicer.vision.fingerprint, "overtaken")
    ask = _by_hash(key, "overtaken")
    ask.await_file_ms = 1000
    asked = slow_encoder.stub.Encode.future(ask, timeout=60)
    _until_awaited(slow_encoder)  # the ask is here first
    GATE.set()
    ahead = slow_encoder.stub.Prefetch(encoder_pb2.PrefetchRequest(
        images=[common_pb2.ImageInput(data=data)], cache_salt="overtaken"), timeout=60)
    reply = asked.result()
    assert ahead.accepted == 1
    assert reply.embeddings[0].content_hash == key and reply.embeddings[0].inline_data
    assert not slow_encoder.servicer.pending._arrivals and len(slow_encoder.servicer.pending) == 0


def test_a_file_that_never_comes_is_not_found_after_the_wait(slow_encoder):
    GATE.set()
    ask = _by_hash("ab" * 32, "never")
    ask.await_file_ms = 100
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        slow_encoder.stub.Encode(ask, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert time.monotonic() - started >= 0.1  # it waited, then answered as before
    assert not slow_encoder.servicer.pending._arrivals  # no waiter left behind


def test_arrival_waiters_share_an_event_and_leave_nothing():
    async def run() -> None:
        pending = PendingFiles()
        key = ("s", "k")
        waiters = [asyncio.create_task(pending.wait_arrival([key], 5.0)) for _ in range(2)]
        await asyncio.sleep(0)
        assert pending._arrivals[key][1] == 2
        pending.end(pending.begin([key]))  # the file arrived (and was done with)
        await asyncio.wait_for(asyncio.gather(*waiters), 5.0)
        assert not pending._arrivals
        await pending.wait_arrival([key], 0.01)  # nothing comes: returns after the timeout
        assert not pending._arrivals

    asyncio.run(run())


@pytest.mark.parametrize("needed_now", [True, False])
def test_a_file_sent_ahead_for_an_arrived_request_is_demand_work(tiny_model_dir, monkeypatch, needed_now):
    """A decoder's send-ahead (needed_now) is produced at demand priority: its batch replays the tower's
    graphs on the demand stream instead of running eagerly as lookahead; a plain Prefetch stays lookahead."""
    harness = EncoderHarness(EncoderConfig(model=tiny_model_dir, cache_bytes=1 << 20, decode_processes=0))
    try:
        worker = harness.servicer.worker
        priorities = []
        real_submit = worker.submit

        def recording(key, image, priority, *args, **kwargs):
            priorities.append(priority)
            return real_submit(key, image, priority, *args, **kwargs)

        monkeypatch.setattr(worker, "submit", recording)
        reply = harness.stub.Prefetch(encoder_pb2.PrefetchRequest(
            images=[common_pb2.ImageInput(data=image_bytes(905))], cache_salt="now", needed_now=needed_now),
            timeout=60)
        assert reply.accepted == 1
        assert priorities == [server_module.DEMAND if needed_now else server_module.PREFETCH]
    finally:
        harness.close()
