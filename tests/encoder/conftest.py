"""Encoder test fixtures: images, and a real grpc.aio encoder server on 127.0.0.1 port 0.

The server runs on its own event loop in a background thread, so tests talk to it with plain
synchronous stubs (no async test plugin needed).
"""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry

from common.images import ImageLimits
from common.pb import common_pb2, encoder_pb2, encoder_pb2_grpc
from encoder_svc.server import SERVICE_NAME, EncoderConfig, EncoderServicer


def image_bytes(seed: int, size: tuple[int, int] = (40, 32), fmt: str = "PNG") -> bytes:
    """A random RGB image file."""
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def encode_request(*images: bytes, accept=(common_pb2.TRANSPORT_SHM,), **kw) -> encoder_pb2.EncodeRequest:
    """An EncodeRequest for image files."""
    return encoder_pb2.EncodeRequest(images=[common_pb2.ImageInput(data=d) for d in images],
                                     accept=list(accept), **kw)


class EncoderHarness:
    """An encoder servicer behind a real gRPC server, on a loop in a background thread."""

    def __init__(self, config: EncoderConfig) -> None:
        self.registry = CollectorRegistry()
        self.servicer = EncoderServicer.build(config, registry=self.registry)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.service = self.call(self._make_service())  # grpc.aio binds to this loop
        self.port = self.call(self.service.start())
        self.call(self.servicer.warm_up())
        self.loop.call_soon_threadsafe(self.service.set_serving, True)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = encoder_pb2_grpc.EncoderServiceStub(self.channel)

    async def _make_service(self):
        # imported here: hosts without grpcio-health-checking can still run the non-server tests
        from common.server import GrpcService

        service = GrpcService("encoder-test", "127.0.0.1", 0)
        service.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, self.servicer, SERVICE_NAME)
        return service

    def call(self, coro, timeout: float = 60):
        """Run a coroutine on the server's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stats(self) -> encoder_pb2.EncoderStats:
        return self.stub.GetStats(common_pb2.StatsRequest(), timeout=10)

    def release_all(self, response: encoder_pb2.EncodeResponse, owner: str = "") -> int:
        """Release the response's leases as `owner` (the lease_owner they were taken with)."""
        ids = [r.lease_id for r in response.embeddings if r.lease_id]
        return self.stub.Release(encoder_pb2.ReleaseRequest(lease_ids=ids, lease_owner=owner),
                                 timeout=10).released

    def close(self) -> None:
        self.channel.close()
        self.call(self.service.stop(0.5))
        self.call(self.servicer.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def encoder_server(tiny_model_dir) -> Iterator[EncoderHarness]:
    """One CPU encoder (SHM arena, 1 MiB cache) shared by a test module.

    Limits: 4 images per request; sides up to 12000 px, so that a decompression bomb (more pixels than
    Pillow's limit) can be told apart from an image that is merely too wide.
    """
    limits = ImageLimits(max_side=12000, max_images_per_request=4)
    harness = EncoderHarness(EncoderConfig(model=tiny_model_dir, cache_bytes=1 << 20, lease_ttl_s=30,
                                           limits=limits))
    yield harness
    harness.close()


@pytest.fixture
def encoder(encoder_server: EncoderHarness) -> Iterator[EncoderHarness]:
    """The module's encoder; after each test, no lease may be left active."""
    yield encoder_server
    assert encoder_server.stats().active_leases == 0, "a test (or the server) leaked a lease"


@pytest.fixture
def owners():
    """Start arena owners in child processes (tests/encoder/test_shm_sweeper.ShmOwner); cleaned up after."""
    from tests.encoder.test_shm_sweeper import ShmOwner

    started: list[ShmOwner] = []

    def start(**kw) -> ShmOwner:
        started.append(ShmOwner(**kw))
        return started[-1]

    yield start
    for owner in started:
        owner.cleanup()
