"""Encoder discovery by DNS against real encoders: three encoder services on 127.0.0.1, .2 and .3 (one
port), behind one name through an injectable resolver, while requests keep coming.

- the ring grows: the new replica takes only its share, every other image stays a cache hit where it was;
- the ring shrinks: only the removed replica's images are encoded again, on their new owners;
- a replica that dies while still in DNS leaves the ring on failed health checks and comes back when it
  serves again; requests in flight to it go to the image's new owner;
- and the real decoder command with `--encoder dns:///localhost:PORT` serves through the system resolver.
"""

from __future__ import annotations

import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from common.checkpoint import model_fingerprint
from common.client import DecoderClient, EncoderClient
from common.hashing import hash_image_file
from decoder_svc.encoders.discovery import EncoderPool
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource, RetryPolicy
from decoder_svc.encoders.routing import HashRing
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingState
from tests.integration.conftest import png
from tests.integration.harness import Service, free_port
from tests.oracle import make_image

NAME = "encoders.test"
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
N_IMAGES = 24
PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"


class LoopbackEncoder(Service):
    """An encoder service bound to one loopback address."""

    def __init__(self, model_dir, host: str, port: int, log_dir) -> None:
        super().__init__(f"encoder-{host}", ["encoder", "--model", str(model_dir), "--host", host], port,
                         log_dir / f"encoder-{host}.log")
        self.host = host

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def misses(self) -> int:
        with EncoderClient(self.address, timeout=10) as client:
            return client.stats().misses


class SettableDns:
    """The injectable resolver: NAME answers whichever loopback addresses the test lists."""

    def __init__(self, ips: list[str]) -> None:
        self.ips = list(ips)
        self._lock = threading.Lock()

    def set(self, ips: list[str]) -> None:
        with self._lock:
            self.ips = list(ips)

    def __call__(self, host: str, port: int) -> list[str]:
        assert host == NAME
        with self._lock:
            return list(self.ips)


@dataclass(frozen=True)
class Img:
    content_hash: str
    data: bytes


class Load:
    """Keeps asking for every image from 4 threads (each its own images, so no two asks of one image
    overlap) until stopped; counts what succeeded and what failed."""

    def __init__(self, source: RemoteEmbeddingSource, images: list[Img]) -> None:
        self.source, self.images = source, images
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._seq = 0
        self._threads: list[threading.Thread] = []

    def ask(self, image: Img) -> None:
        """One request for one image, to the end (READY or FAILED)."""
        with self._lock:
            self._seq += 1
            rid = f"load-{self._seq}"
        self.source.request(EmbeddingRequest(rid, image.content_hash, image.data))
        status = wait_for(lambda: self.source.poll(rid, image.content_hash) != EmbeddingState.PENDING, 60)
        status = self.source.poll(rid, image.content_hash)
        with self._lock:
            if status == EmbeddingState.READY:
                self.ok += 1
            else:
                error = self.source.error(rid, image.content_hash)
                self.failures.append(f"{image.content_hash[:12]}: {status} {error}")
        self.source.release(rid)

    def _run(self, mine: list[Img]) -> None:
        while not self._stop.is_set():
            for image in mine:
                self.ask(image)

    def __enter__(self) -> Load:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._run, args=(self.images[i::4],), daemon=True)
                         for i in range(4)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def passes(self) -> int:
        with self._lock:
            return self.ok


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def one_round(load: Load) -> None:
    """Every image once more, quietly (no membership change in flight)."""
    for image in load.images:
        load.ask(image)


def owners(members: list[str], images: list[Img]) -> dict[str, str]:
    ring = HashRing(members)
    return {im.content_hash: ring.route(im.content_hash) for im in images}


@pytest.fixture(scope="module")
def encoders(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log_dir = tmp_path_factory.mktemp("dns")
    started = [LoopbackEncoder(tiny_model_dir, host, port, log_dir) for host in HOSTS]
    try:
        for enc in started:
            enc.start()
        yield started
    finally:
        for enc in started:
            enc.stop()


@pytest.fixture(scope="module")
def images(tiny_model_dir) -> list[Img]:
    fingerprint = model_fingerprint(tiny_model_dir)
    picked = [make_image(500 + i) for i in range(N_IMAGES)]
    return [Img(hash_image_file(png(im), fingerprint), png(im)) for im in picked]


def test_ring_grows_shrinks_and_ejects_under_load(encoders, images):
    a, b, c = encoders
    port = a.port
    dns = SettableDns([a.host, b.host])
    pool = EncoderPool([f"dns:///{NAME}:{port}"], resolver=dns, interval_s=0.2, eject_after=2)
    source = RemoteEmbeddingSource(pool, retry=RetryPolicy(total_timeout_s=60.0))
    load = Load(source, images)
    try:
        assert sorted(pool.members) == [a.address, b.address]
        one_round(load)  # every image now lives on its owner among A and B
        first = owners([a.address, b.address], images)
        assert {first[i.content_hash] for i in images} == {a.address, b.address}
        misses = {e.address: e.misses() for e in encoders}
        assert misses == {a.address: list(first.values()).count(a.address),
                          b.address: list(first.values()).count(b.address), c.address: 0}

        # Grow under load: C joins within the re-resolve interval and takes its share only.
        with load:
            dns.set([a.host, b.host, c.host])
            assert wait_for(lambda: c.address in pool.members, 30), pool.members
            passes = load.passes()
            assert wait_for(lambda: load.passes() > passes + N_IMAGES, 120)  # a full cycle after the change
        grown = owners([a.address, b.address, c.address], images)
        to_c = [h for h, o in grown.items() if o == c.address]
        assert to_c and all(first[h] != c.address for h in to_c)
        assert all(grown[h] == first[h] for h in grown if h not in to_c)  # nothing moved between A and B
        one_round(load)
        after_grow = {e.address: e.misses() for e in encoders}
        # A and B encoded nothing again: every image still routed to them was a cache hit there.
        assert after_grow[a.address] == misses[a.address] and after_grow[b.address] == misses[b.address]
        assert after_grow[c.address] == len(to_c)  # C encoded exactly the images that moved to it

        # Shrink under load: A leaves DNS (as a Pod being scaled away), then stops.
        with load:
            dns.set([b.host, c.host])
            assert wait_for(lambda: a.address not in pool.members, 30), pool.members
            a.stop()
            passes = load.passes()
            assert wait_for(lambda: load.passes() > passes + N_IMAGES, 120)
        shrunk = owners([b.address, c.address], images)
        from_a = [h for h, o in grown.items() if o == a.address]
        assert all(shrunk[h] == grown[h] for h in grown if h not in from_a)  # only A's images moved
        one_round(load)
        after_shrink = {e.address: e.misses() for e in (b, c)}
        for enc in (b, c):
            moved_here = sum(1 for h in from_a if shrunk[h] == enc.address)
            assert after_shrink[enc.address] == after_grow[enc.address] + moved_here

        # Health: C dies while DNS still lists it; it leaves the ring, then returns when it serves again.
        with load:
            c.stop(signal.SIGKILL)
            assert wait_for(lambda: pool.members == [b.address], 30), pool.members
            passes = load.passes()
            assert wait_for(lambda: load.passes() > passes + N_IMAGES, 120)
            c.start()
            assert wait_for(lambda: sorted(pool.members) == [b.address, c.address], 30), pool.members
            passes = load.passes()
            assert wait_for(lambda: load.passes() > passes + N_IMAGES, 120)
        assert load.failures == []  # every request, across every change, got its embedding
        assert source.stats().embedding_failures == 0
    finally:
        source.close()


def test_decoder_command_routes_through_dns(encoders, tiny_model_dir, tmp_path, images):
    """`mmserve decoder --encoder dns:///localhost:PORT`: the system resolver, real health checks (an
    address of localhost that nothing serves, such as ::1, stays out of the ring), the ring's size in
    the decoder's metrics."""
    a = encoders[0]
    if a.proc is None:
        a.start()  # the test above stops it
    metrics_port = free_port()
    decoder = Service("decoder", ["decoder", "--model", str(tiny_model_dir), "--encoder",
                                  f"dns:///localhost:{a.port}", "--encoder-resolve-interval", "0.5",
                                  "--metrics-port", str(metrics_port)],
                      free_port(), tmp_path / "decoder.log")
    decoder.start()
    try:
        before = a.misses()
        with DecoderClient(decoder.address, timeout=120) as client:
            result = client.generate_text(PROMPT, [images[0].data], max_tokens=2, cache_salt="dns-cli")
        assert result.usage.images == 1
        assert a.misses() == before + 1  # the image went to the encoder behind localhost

        def ring_size() -> str:
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
            return re.search(r"^mmserve_decoder_encoders (\S+)$", text.decode(), re.M).group(1)

        assert wait_for(lambda: ring_size() == "1.0", 30), ring_size()
    finally:
        decoder.stop()
