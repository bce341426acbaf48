"""Leases when a request ends while its image is still being encoded, and a cache that holds two
embeddings under concurrent requests.

The encoder runs in this process (tests/encoder/conftest.py's harness) so that its vision tower can be
held at a gate: an Encode stays in flight for as long as a test wants, with no hook in the service. The
decoder is the real service in a subprocess, talking to it over gRPC and shared memory like any other.
Room for two embeddings, a budget of 7 tokens per step (every 16-token image spans three chunks), leases
of 30 s: anything given back "by the TTL" would be far too late for these tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest

from common.client import DecoderClient
from common.hashing import hash_image_file
from common.startup import free_port
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource, RetryPolicy
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingState
from encoder_svc.server import EncoderConfig
from tests.encoder.conftest import EncoderHarness
from tests.integration.conftest import png
from tests.integration.harness import Service
from tests.oracle import make_image

SLOT = 16 * 64 * 4  # one tiny-model embedding: 16 tokens x 64 hidden, fp32
TTL_S = 30.0
FAST_S = 5.0  # "well before the TTL"
N = 8
PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"
# More than one block of text before the image: the request holds KV blocks while it waits for it.
LONG = ("USER: here is a long preamble that fills more than one block of tokens for sure, then "
        "<image>\nwhat is it? ASSISTANT:")
TEXT = "USER: Tell me a story about a red car. ASSISTANT:"


class Gate:
    """Wraps the vision tower's encode: while closed, an encode that starts waits until it opens."""

    def __init__(self, encode: Callable) -> None:
        self._encode = encode
        self._open = threading.Event()
        self._open.set()
        self.entered = threading.Event()  # an encode reached the gate while it was closed

    def __call__(self, images, **kw):
        if not self._open.is_set():
            self.entered.set()
            if not self._open.wait(60):
                raise RuntimeError("the test never opened the gate")
        return self._encode(images, **kw)

    @contextmanager
    def closed(self) -> Iterator[None]:
        self.entered.clear()
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()


class GatedPair:
    """An in-process gated encoder and a decoder service in a subprocess."""

    def __init__(self, model_dir, workdir) -> None:
        self.encoder = EncoderHarness(EncoderConfig(model=model_dir, cache_bytes=2 * SLOT, lease_ttl_s=TTL_S))
        self.vision = self.encoder.servicer.vision
        self.gate = Gate(self.vision.encode_prepared)
        self.vision.encode_prepared = self.gate  # the worker calls self.vision.encode_prepared
        self.address = f"127.0.0.1:{self.encoder.port}"
        self.releases: list[tuple[str, int]] = []  # (owner, leases freed) per Release the encoder served
        cache = self.encoder.servicer.cache
        release = cache.release

        def recording_release(lease_ids, owner=""):
            freed = release(lease_ids, owner)
            self.releases.append((owner, freed))
            return freed

        cache.release = recording_release
        self.decoder = Service("decoder", [
            "decoder", "--model", str(model_dir), "--encoder", self.address, "--num-kv-blocks", "256",
            "--max-num-batched-tokens", "7", "--max-tokens-default", "8", "--encoder-timeout", "20"],
            free_port(), workdir / "decoder.log")
        try:
            self.decoder.start()
        except BaseException:
            self.encoder.close()
            raise

    def key(self, image, salt: str = "") -> str:
        """The content hash both services give this image."""
        return hash_image_file(png(image), self.vision.fingerprint, salt)

    def decoder_stats(self):
        with DecoderClient(self.decoder.address, timeout=10) as client:
            return client.stats()

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float) -> float:
        """Seconds until predicate() held; fails after timeout."""
        start = time.monotonic()
        while not predicate():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"not within {timeout} s: {what}")
            time.sleep(0.02)
        return time.monotonic() - start

    def assert_idle(self, timeout: float = 10.0) -> None:
        """No running or waiting request, no KV block used, no lease on the encoder."""
        def idle() -> bool:
            d = self.decoder_stats()
            busy = (d.running, d.waiting, d.kv_blocks_used, self.encoder.stats().active_leases)
            return busy == (0, 0, 0, 0)

        self.wait_for("decoder and encoder idle", idle, timeout)

    def close(self) -> None:
        self.decoder.stop()
        self.encoder.close()


@pytest.fixture(scope="module")
def gated(tiny_model_dir, tmp_path_factory) -> Iterator[GatedPair]:
    pair = GatedPair(tiny_model_dir, tmp_path_factory.mktemp("gated"))
    yield pair
    pair.close()


@pytest.fixture
def idle(gated: GatedPair) -> Iterator[GatedPair]:
    """The module's pair; every test leaves it with no request, block or lease."""
    gated.assert_idle()
    yield gated
    gated.assert_idle()


def test_source_release_while_fetch_in_flight_cancels_it_and_leaves_no_lease(idle):
    """The request ends while its Encode is still running: the source cancels the Encode (issue 38: the
    encoder may stop work nobody waits for), so no lease is ever handed to it; the encode already in the
    tower is stored, no lease is left at the encoder, and the source keeps nothing of the key."""
    image = make_image(301)
    key = idle.key(image)
    source = RemoteEmbeddingSource([idle.address], retry=RetryPolicy(total_timeout_s=20))
    try:
        with idle.gate.closed():
            source.request(EmbeddingRequest("gone", key, png(image)))
            assert idle.gate.entered.wait(10), "the encode never started"
            source.release("gone")
            assert source.poll("gone", key) == EmbeddingState.UNKNOWN
            assert not idle.encoder.servicer.cache.contains(key)  # still in flight
        idle.wait_for("the encode is stored", lambda: idle.encoder.servicer.cache.contains(key), FAST_S)
        idle.wait_for("no lease is left", lambda: idle.encoder.stats().active_leases == 0, FAST_S)
        assert (source._lease_owner, 1) not in idle.releases, "the cancelled call still got a lease"
        assert source.poll("gone", key) == EmbeddingState.UNKNOWN
        assert source.stats().active_leases == 0 and source.stats().embedding_failures == 0
        # The source is still of use: the same image for a live request lands (a hit) and is READY.
        source.request(EmbeddingRequest("live", key, png(image)))
        idle.wait_for("the live key is ready", lambda: source.is_ready("live", key), FAST_S)
        assert source.cache_hit("live", key) and tuple(source.get("live", key).shape) == (16, 64)
        source.release("live")
    finally:
        source.close()


def test_stream_cancelled_while_its_image_is_encoded_frees_blocks_and_lease(idle):
    """A Generate stream cancelled while its image is being encoded (its text before the image already in
    KV): the decoder frees its blocks at once, and the lease the late answer carries is back on the
    encoder within seconds of the encode finishing."""
    image = make_image(302)
    key = idle.key(image, "cancel")
    before = idle.decoder_stats()
    with DecoderClient(idle.decoder.address, timeout=60) as client, idle.gate.closed():
        stream = client.generate(LONG, [png(image)], max_tokens=N, cache_salt="cancel")
        assert idle.gate.entered.wait(20), "the encode never started"
        idle.wait_for("the text before the image is in KV", lambda: idle.decoder_stats().kv_blocks_used > 0,
                      FAST_S)
        stream.cancel()
        with pytest.raises(grpc.RpcError) as err:
            next(stream)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        idle.wait_for("the decoder aborted the request and freed its blocks",
                      lambda: idle.decoder_stats().requests_aborted == before.requests_aborted + 1, FAST_S)
        d = idle.decoder_stats()
        assert (d.running, d.waiting, d.kv_blocks_used) == (0, 0, 0)
        assert not idle.encoder.servicer.cache.contains(key, "cancel")  # the encode is still held at the gate
    idle.wait_for("the encode is stored", lambda: idle.encoder.servicer.cache.contains(key, "cancel"), FAST_S)
    idle.wait_for("the late answer's lease is given back", lambda: idle.encoder.stats().active_leases == 0,
                  FAST_S)


def test_unready_image_stalls_only_its_own_request(idle, oracle):
    """While one request's image is held at the encoder, a text request is served to the end; the image
    request answers once its image arrives, equal to HF."""
    image = make_image(303)
    with DecoderClient(idle.decoder.address, timeout=60) as client, ThreadPoolExecutor(1) as pool:
        with idle.gate.closed():
            waiting = pool.submit(client.generate_text, PROMPT, [png(image)], max_tokens=N,
                                  cache_salt="stall")
            assert idle.gate.entered.wait(20), "the encode never started"
            text = client.generate_text(TEXT, max_tokens=N)
            assert text.finish_reason == "LENGTH" and len(text.token_ids) == N
            assert not waiting.done()
        result = waiting.result(60)  # the gate is open again: the image arrives and the request completes
    oracle.assert_same_tokens(text.token_ids, TEXT, [], N)
    oracle.assert_same_tokens(result.token_ids, PROMPT, [image], N)


def test_concurrent_requests_under_cache_pressure_match_hf(idle, oracle, test_images):
    """Six concurrent requests, five different images (one of them twice), an encoder cache that holds
    two embeddings and a decoder that splits every image over three chunks: every answer equals HF."""
    images = [*test_images, make_image(304)]
    jobs = [(PROMPT, images[0]), (LONG, images[1]), (PROMPT, images[2]), (PROMPT, images[3]),
            (LONG, images[4]), (PROMPT, images[0])]
    evictions = idle.encoder.stats().evictions

    def run(job):
        prompt, image = job
        with DecoderClient(idle.decoder.address, timeout=120) as client:
            return client.generate_text(prompt, [png(image)], max_tokens=N, cache_salt="pressure")

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (prompt, image), result in zip(jobs, results, strict=True):
        oracle.assert_same_tokens(result.token_ids, prompt, [image], N)
    assert idle.encoder.stats().evictions >= evictions + 3, "the cache was never under pressure"
    idle.assert_idle()  # no request, KV block or lease left
