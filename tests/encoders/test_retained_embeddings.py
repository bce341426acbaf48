"""Embeddings the decoder keeps after their requests (decoder_svc/encoders/retained.py, the remote source's
--embedding-retain-bytes): the LRU's budget and order; through the remote source, a later request with
the same image is READY at its ask without an Encode, with the same rows, and only for the same tenant
salt and resize settings; nothing is kept with a budget of 0 or from a failed image; every lease goes back
as before (a kept tensor is the decoder's own copy, not a lease).

No encoder runs: test_lookahead_pools.py's fake stub plays one (each Encode leases fresh rows)."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from common.image_geometry import PixelRange
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource
from decoder_svc.encoders.retained import RetainedEmbeddings, retain_key
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingState
from tests.encoders.test_lookahead_pools import _RETRY, ENCODER, HIDDEN, FakeEncoder, _hash

pytestmark = pytest.mark.timeout(60)

ROW_BYTES = 3 * HIDDEN * 4  # the fake's embeddings: 3 rows of HIDDEN fp32


def _rows(n: int, value: float = 1.0) -> torch.Tensor:
    return torch.full((n, 4), value)  # n * 16 bytes


def test_the_lru_keeps_within_its_budget_least_recently_used_out_first():
    kept = RetainedEmbeddings(budget_bytes=3 * 16)
    for key in "abc":
        kept.keep(key, _rows(1))
    assert kept.take("a") is not None  # a is now the most recently used: b goes first
    kept.keep("d", _rows(1))
    assert kept.take("b") is None and len(kept) == 3 and kept.evictions == 1
    kept.keep("e", _rows(2))  # needs two entries' room: c, then a (d was kept after a was used)
    assert [k for k in "acd" if kept.take(k) is not None] == ["d"] and kept.take("e") is not None
    assert kept.bytes_held == 3 * 16 and kept.evictions == 3
    kept.keep("big", _rows(4))  # larger than the whole budget: not kept, nothing dropped for it
    assert kept.take("big") is None and kept.bytes_held == 3 * 16 and kept.evictions == 3
    kept.keep("d", _rows(1, 9.0))  # a key kept already stays as it was
    assert float(kept.take("d")[0, 0]) == 1.0 and kept.bytes_held == 3 * 16
    kept.clear()
    assert len(kept) == 0 and kept.bytes_held == 0
    with pytest.raises(ValueError, match="budget_bytes"):
        RetainedEmbeddings(-1)


def test_the_key_holds_the_salt_and_the_resize_settings_not_the_request():
    base = EmbeddingRequest("r1", _hash("a"), b"png", cache_salt="t1")
    assert retain_key(base) == retain_key(EmbeddingRequest("r2", _hash("a"), None, cache_salt="t1",
                                                           prefetch=True))
    assert retain_key(base) != retain_key(EmbeddingRequest("r1", _hash("a"), b"png", cache_salt="t2"))
    assert retain_key(base) != retain_key(EmbeddingRequest("r1", _hash("a"), b"png", cache_salt="t1",
                                                           pixels=PixelRange(min_pixels=1, max_pixels=2)))


@pytest.fixture
def rig(monkeypatch):
    encoder = FakeEncoder()

    def make(retain_bytes: int) -> RemoteEmbeddingSource:
        source = RemoteEmbeddingSource([ENCODER], retry=_RETRY, max_workers=2, lease_owner="test-owner",
                                       retain_bytes=retain_bytes)
        monkeypatch.setattr(source, "_stub", lambda _: encoder)
        made.append(source)
        return source

    made: list[RemoteEmbeddingSource] = []
    yield encoder, make
    for source in made:
        source.close()


def _settle(source: RemoteEmbeddingSource, rid: str, name: str, timeout_s: float = 5.0) -> None:
    """Until the key is no longer PENDING (bounded)."""
    deadline = time.monotonic() + timeout_s
    while source.poll(rid, _hash(name)) == EmbeddingState.PENDING and time.monotonic() < deadline:
        time.sleep(0.001)


def _ready(source: RemoteEmbeddingSource, rid: str, name: str, salt: str = "",
           pixels: PixelRange | None = None) -> torch.Tensor:
    """Ask for the image, wait until READY (bounded), return its rows."""
    source.request(EmbeddingRequest(rid, _hash(name), b"png bytes", cache_salt=salt, pixels=pixels))
    _settle(source, rid, name)
    assert source.poll(rid, _hash(name)) == EmbeddingState.READY, source.error(rid, _hash(name))
    return source.get(rid, _hash(name)).clone()


def test_a_later_request_with_the_same_image_is_ready_at_its_ask_with_no_encode(rig):
    encoder, make = rig
    source = make(retain_bytes=10 * ROW_BYTES)
    first = _ready(source, "r1", "a")
    assert len(encoder.encodes("a")) == 1 and not source.cache_hit("r1", _hash("a"))
    assert source.stats().embeddings_retained_bytes == 0  # kept once its request is done with it
    source.release("r1")
    assert source.stats().embeddings_retained_bytes == ROW_BYTES

    source.request(EmbeddingRequest("r2", _hash("a"), b"png bytes"))
    assert source.poll("r2", _hash("a")) == EmbeddingState.READY  # at the ask: nothing to wait for
    # a cache hit (the Usage's images_encoder_cache_hits counts it), served here
    assert torch.equal(source.get("r2", _hash("a")), first) and source.cache_hit("r2", _hash("a"))
    assert len(encoder.encodes("a")) == 1
    stats = source.stats()
    assert stats.embeddings_retained_hits == 1 and stats.embeddings_requested == 1
    assert stats.active_leases == 0
    source.release("r2")
    encoder.wait_all_released()  # the one lease (r1's) went back after its copy, as without retention


def test_another_tenant_salt_or_resize_setting_asks_the_encoder(rig):
    encoder, make = rig
    source = make(retain_bytes=10 * ROW_BYTES)
    _ready(source, "r1", "a", salt="tenant-1")
    source.release("r1")
    _ready(source, "r2", "a", salt="tenant-2")
    _ready(source, "r3", "a", salt="tenant-1", pixels=PixelRange(min_pixels=64, max_pixels=4096))
    assert len(encoder.encodes("a")) == 3 and source.stats().embeddings_retained_hits == 0
    _ready(source, "r4", "a", salt="tenant-1")
    assert len(encoder.encodes("a")) == 3 and source.stats().embeddings_retained_hits == 1


def test_nothing_is_kept_with_no_budget_or_from_a_failed_image(rig):
    encoder, make = rig
    source = make(retain_bytes=0)
    _ready(source, "r1", "a")
    source.release("r1")
    _ready(source, "r2", "a")
    assert len(encoder.encodes("a")) == 2 and source.stats().embeddings_retained_bytes == 0

    kept = make(retain_bytes=10 * ROW_BYTES)
    encoder.failing[_hash("bad")] = grpc.StatusCode.INVALID_ARGUMENT
    kept.request(EmbeddingRequest("r3", _hash("bad"), b"png bytes"))
    _settle(kept, "r3", "bad")
    assert kept.poll("r3", _hash("bad")) == EmbeddingState.FAILED
    kept.release("r3")
    assert kept.stats().embeddings_retained_bytes == 0


def test_close_drops_what_is_kept(rig):
    _, make = rig
    source = make(retain_bytes=10 * ROW_BYTES)
    _ready(source, "r1", "a")
    source.release("r1")
    source.close()
    assert source.stats().embeddings_retained_bytes == 0
