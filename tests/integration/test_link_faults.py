"""Faults on the link between a decoder's embedding fetches and an encoder (issue 67): an answer lost on a
reset connection leaves no lease behind once the image was asked for again, and a drain that runs out of
time leaves none behind either, however the engine core stopped; neither waits for the TTL.

The encoder runs with a 600 s lease TTL, so a lease still held a few seconds after the fetch is a leak,
not a lease waiting out its time. The fault: a proxy between them drops the encoder's answer (it carries
the image's content hash) and resets the decoder's connection, keeping the encoder's open, so the encoder
wrote its whole answer (lease granted) and the decoder saw only a broken link and asked again.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from bench.fault_proxy import FaultProxy
from common.client import DecoderClient, EncoderClient
from common.startup import free_port
from common.transport.shm import shm_available
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource, RetryPolicy
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingState
from tests.integration.conftest import png
from tests.integration.harness import Service
from tests.oracle import make_image

PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"
BOUND_S = 60.0  # generous bounds on a loaded 2-core VM: each is a wait for a state, never a timing


@pytest.fixture
def encoder(tiny_model_dir, tmp_path):
    service = Service("encoder", ["encoder", "--model", str(tiny_model_dir), "--lease-ttl", "600"],
                      free_port(), tmp_path / "encoder.log")
    service.start()
    try:
        yield service
    finally:
        service.stop()


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.skipif(not shm_available(), reason="the leased transport on CPU is shared memory")
def test_a_lease_whose_answer_a_reset_link_lost_is_released_after_the_retry(encoder):
    proxy = FaultProxy(encoder.port).start()
    source = None
    try:
        with EncoderClient(encoder.address, timeout=60) as enc:
            ref = enc.encode([png(make_image(67))]).embeddings[0]  # cached: the decoder's ask by hash hits
            assert enc.stats().active_leases == 0
            proxy.cut_answer_with = ref.content_hash.encode()
            source = RemoteEmbeddingSource([proxy.address], retry=RetryPolicy(total_timeout_s=BOUND_S))
            h = ref.content_hash
            source.request(EmbeddingRequest("r1", h, None))
            _wait(lambda: source.poll("r1", h) != EmbeddingState.PENDING, "no answer")
            assert source.poll("r1", h) == EmbeddingState.READY, source.error("r1", h)
            assert proxy.answers_cut == 1  # the first answer was lost, the second read
            assert source.stats().embedding_transports == {"shm": 1}  # leased, not inline
            source.release("r1")
            # Both answers' leases go back: the read one's by id, the lost one's by its ask's name.
            deadline = time.monotonic() + 10.0
            while enc.stats().active_leases and time.monotonic() < deadline:
                time.sleep(0.05)
            stats = enc.stats()
            assert stats.active_leases == 0 and stats.leased_bytes == 0
            assert stats.expired_leases == 0  # released, not timed out
    finally:
        if source is not None:
            source.close()
        proxy.stop()


@pytest.mark.skipif(not shm_available(), reason="the leased transport on CPU is shared memory")
def test_a_drain_that_runs_out_of_time_leaves_no_encoder_lease(encoder, tiny_model_dir, tmp_path):
    """The encoder answered the request's Encode (a lease granted) on a link that then stalled: the
    decoder never read the answer, and what its engine core sends on that link (the cancel, the Release
    by the ask's name) never arrives. SIGTERM with a drain timeout the request outlives: the front end
    gives the ended request's leases back at the encoder (on a link of its own) before it exits."""
    proxy = FaultProxy(encoder.port).start()
    decoder = Service("decoder", ["decoder", "--model", str(tiny_model_dir), "--encoder", proxy.address,
                                  "--drain-timeout", "0.5"], free_port(), tmp_path / "decoder.log")
    try:
        decoder.start()
        image = png(make_image(68))
        with EncoderClient(encoder.address, timeout=60) as enc:
            ref = enc.encode([image]).embeddings[0]  # cached: the core's ask by hash is answered at once
            proxy.hold_answer_with = ref.content_hash.encode()
            result: dict = {}

            def run() -> None:
                try:
                    with DecoderClient(decoder.address, timeout=120) as client:
                        result["text"] = client.generate_text(PROMPT, [image], max_tokens=4)
                except grpc.RpcError as exc:
                    result["error"] = exc.code()

            thread = threading.Thread(target=run)
            thread.start()
            _wait(lambda: proxy.answers_held == 1 and enc.stats().active_leases == 1, "no held answer")
            decoder.proc.send_signal(signal.SIGTERM)
            assert decoder.proc.wait(60) == 0
            thread.join(60)
            assert result.get("error") == grpc.StatusCode.UNAVAILABLE, result  # ended by the drain timeout
            deadline = time.monotonic() + 10.0
            while enc.stats().active_leases and time.monotonic() < deadline:
                time.sleep(0.05)
            stats = enc.stats()
            assert stats.active_leases == 0 and stats.leased_bytes == 0 and stats.expired_leases == 0
    finally:
        decoder.stop()
        proxy.stop()
