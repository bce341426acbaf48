"""A file sent ahead belongs to its request (issue 63): its production lives while that request's ask
does, or another request's; it stops once the asks are gone, or when no ask came within the claim
time. Counted in the cache's still_wanted answers and abandoned productions, on a fake clock."""

from __future__ import annotations

import torch

from common.transport.arena import TensorArena
from encoder_svc.cache import EmbeddingCache
from tests.encoder.test_cache import ITEM, FakeClock

CLAIM_S = 10.0


def _cache() -> tuple[EmbeddingCache, FakeClock]:
    clock = FakeClock()
    return EmbeddingCache(TensorArena(8 * ITEM), clock=clock, sent_ahead_claim_s=CLAIM_S), clock


def _send_ahead(cache: EmbeddingCache) -> bool:
    """A decoder's Prefetch with needed_now: True when it started the production."""
    return cache.acquire("f", want_lease=False, for_ask=True)[1]


def test_a_production_sent_ahead_stops_when_its_requests_ask_is_cancelled():
    cache, _ = _cache()
    assert _send_ahead(cache)
    ask, _ = cache.acquire("f", want_lease=True, produce=False)  # the request's Encode by hash joins
    assert cache.still_wanted("f") and cache.waiters("f") == 1  # the stand-in stepped aside
    ask.cancel()  # the request ended: the decoder cancelled its Encode
    assert not cache.still_wanted("f") and cache.abandoned == 1


def test_a_production_sent_ahead_whose_ask_never_comes_stops_after_the_claim_time():
    cache, clock = _cache()
    assert _send_ahead(cache)
    clock.t = CLAIM_S - 1
    assert cache.still_wanted("f")
    clock.t = CLAIM_S
    assert not cache.still_wanted("f") and cache.abandoned == 1


def test_a_production_shared_by_a_live_request_goes_on():
    cache, clock = _cache()
    assert _send_ahead(cache)
    assert not _send_ahead(cache)  # a second request sent the same file ahead: it joins
    first_ask, _ = cache.acquire("f", want_lease=True, produce=False)
    first_ask.cancel()  # the first request ended; the second has not asked yet
    assert cache.still_wanted("f")
    second_ask, _ = cache.acquire("f", want_lease=True, produce=False)
    clock.t = 10 * CLAIM_S  # asked: no claim time applies any more
    assert cache.still_wanted("f")
    cache.complete("f", torch.zeros(8, 32))
    handle = second_ask.result(0)
    assert handle.lease_id and cache.abandoned == 0
    cache.release([handle.lease_id])


def test_a_lookahead_prefetch_is_always_wanted():
    cache, clock = _cache()
    assert cache.acquire("f", want_lease=False)[1]  # a plain Prefetch (lookahead), not sent ahead
    clock.t = 10 * CLAIM_S
    assert cache.still_wanted("f")
