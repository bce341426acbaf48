"""The embedding cache: hits, LRU eviction of unleased entries, leases, TTL, full cache, dedup."""

from __future__ import annotations

import threading

import pytest
import torch

from common.transport.arena import ALIGNMENT, TensorArena
from encoder_svc.cache import CacheFullError, EmbeddingCache, ItemTooLargeError, SaltClashError

ITEM = ALIGNMENT * 4  # bytes of one test embedding (fp32 [8, 32])


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _tensor(seed: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))


def _put(cache: EmbeddingCache, key: str, seed: int, want_lease: bool = True):
    fut, produce = cache.acquire(key, want_lease)
    assert produce
    cache.complete(key, _tensor(seed))
    return fut.result(0)


def test_miss_then_hit_reads_same_values():
    cache = EmbeddingCache(TensorArena(8 * ITEM))
    h = _put(cache, "a", 1)
    assert not h.hit and h.lease_id
    fut, produce = cache.acquire("a")
    h2 = fut.result(0)
    assert not produce and h2.hit and h2.lease_id != h.lease_id
    assert torch.equal(cache.read(h2.entry), _tensor(1))
    s = cache.stats()
    assert (s.hits, s.misses, s.entries, s.active_leases, s.leased_bytes) == (1, 1, 1, 2, ITEM)
    assert cache.release([h.lease_id, h2.lease_id, "unknown", h.lease_id]) == 2
    assert cache.stats().active_leases == 0 and cache.stats().leased_bytes == 0


def test_leased_entries_survive_eviction_unleased_go_lru_first():
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    pinned = _put(cache, "pinned", 0)
    for i, key in enumerate(["old", "mid", "new"]):
        _put(cache, key, i + 1, want_lease=False)
    cache.acquire("old", want_lease=False)  # touch: "old" becomes most recently used
    _put(cache, "x", 9, want_lease=False)  # needs one slot: evicts the LRU unleased entry, "mid"
    assert cache.contains("old") and not cache.contains("mid") and cache.contains("new")
    for i in range(3):
        _put(cache, f"y{i}", 10 + i, want_lease=False)
    assert cache.contains("pinned"), "a leased entry was evicted"
    assert torch.equal(cache.read(pinned.entry), _tensor(0)), "a leased entry was overwritten"
    assert cache.stats().evictions == 4
    cache.release([pinned.lease_id])


def test_full_of_leases_refuses_and_keeps_entries_intact():
    cache = EmbeddingCache(TensorArena(2 * ITEM))
    a, b = _put(cache, "a", 1), _put(cache, "b", 2)
    with pytest.raises(CacheFullError):  # fast path: refused before any vision work
        cache.acquire("c", expected_nbytes=ITEM)
    fut, produce = cache.acquire("c")  # slow path: the producer finds no room
    assert produce
    cache.complete("c", _tensor(3))
    with pytest.raises(CacheFullError):
        fut.result(0)
    assert torch.equal(cache.read(a.entry), _tensor(1)) and torch.equal(cache.read(b.entry), _tensor(2))
    cache.release([a.lease_id])
    assert not _put(cache, "c", 3).hit  # room again: "a" is evicted, "c" stored (a retry works)
    assert not cache.contains("a") and cache.contains("b")
    cache.release([b.lease_id])


def test_item_larger_than_cache_is_rejected():
    cache = EmbeddingCache(TensorArena(ITEM))
    with pytest.raises(ItemTooLargeError):
        cache.acquire("big", expected_nbytes=2 * ITEM)
    fut, _ = cache.acquire("big")
    cache.complete("big", torch.zeros(2 * ITEM // 4))
    with pytest.raises(ItemTooLargeError):
        fut.result(0)
    assert cache.stats().entries == 0


def test_unreleased_lease_expires_and_unpins():
    clock = FakeClock()
    cache = EmbeddingCache(TensorArena(ITEM), lease_ttl_s=5.0, clock=clock)
    h = _put(cache, "a", 1)
    with pytest.raises(CacheFullError):
        cache.acquire("b", expected_nbytes=ITEM)
    clock.t = 4.9
    assert cache.stats().active_leases == 1
    clock.t = 5.0
    s = cache.stats()
    assert (s.active_leases, s.expired_leases, s.leased_bytes) == (0, 1, 0)
    _put(cache, "b", 2, want_lease=False)  # "a" is evictable again
    assert not cache.contains("a")
    assert cache.release([h.lease_id]) == 0  # releasing an expired lease is a no-op


def test_inflight_dedup_one_production_many_waiters():
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    results, producers = [], []
    barrier = threading.Barrier(16)

    def request():
        barrier.wait()
        fut, produce = cache.acquire("img")
        producers.append(produce)
        if produce:
            threading.Timer(0.05, cache.complete, ("img", _tensor(5))).start()
        results.append(fut.result(5))

    threads = [threading.Thread(target=request) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert producers.count(True) == 1
    assert len({h.lease_id for h in results}) == 16
    s = cache.stats()
    assert s.misses == 1 and s.hits + s.inflight_dedups == 15 and s.active_leases == 16
    cache.release([h.lease_id for h in results])
    assert cache.stats().active_leases == 0


def test_failed_production_reaches_every_waiter_and_allows_retry():
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    f1, p1 = cache.acquire("a")
    f2, p2 = cache.acquire("a")
    assert p1 and not p2
    cache.fail("a", RuntimeError("tower broke"))
    for f in (f1, f2):
        with pytest.raises(RuntimeError, match="tower broke"):
            f.result(0)
    assert cache.acquire("a")[1], "after a failure the next request produces again"


def test_cancelled_waiter_gets_no_lease():
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    f1, _ = cache.acquire("a")
    f2, _ = cache.acquire("a")
    assert f2.cancel()
    cache.complete("a", _tensor(1))
    assert cache.stats().active_leases == 1
    cache.release([f1.result(0).lease_id])


def test_produce_false_does_not_create_pending():
    cache = EmbeddingCache(TensorArena(ITEM))
    assert cache.acquire("nope", produce=False) == (None, False)
    assert cache.stats().misses == 0


# -- tenant isolation (issue 13) -------------------------------------------------------------------


def _put_salted(cache: EmbeddingCache, key: str, seed: int, salt: str, owner: str = ""):
    fut, produce = cache.acquire(key, salt=salt, owner=owner)
    assert produce
    cache.complete(key, _tensor(seed))
    return fut.result(0)


def test_hash_only_access_resolves_only_under_the_entrys_salt():
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    made = _put_salted(cache, "k", 1, salt="tenant-a")
    before = cache.stats()
    # Another salt (the empty one included) sees nothing: no handle, no lease, no counter moves.
    for salt in ("tenant-b", ""):
        assert cache.acquire("k", produce=False, salt=salt) == (None, False)
        assert not cache.contains("k", salt)
        assert cache.lease("k", salt=salt) is None
    after = cache.stats()
    assert (after.hits, after.misses, after.active_leases) == (before.hits, before.misses, 1)
    # The right salt gets the very entry.
    assert cache.contains("k", "tenant-a")
    fut, produce = cache.acquire("k", produce=False, salt="tenant-a")
    h = fut.result(0)
    assert not produce and h.hit and torch.equal(cache.read(h.entry), _tensor(1))
    leased = cache.lease("k", salt="tenant-a")
    assert leased is not None and leased.hit
    assert cache.release([made.lease_id, h.lease_id, leased.lease_id]) == 3


def test_hash_only_ask_does_not_join_another_salts_production():
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    producer, produce = cache.acquire("k", salt="tenant-a")
    assert produce
    assert cache.acquire("k", produce=False, salt="tenant-b") == (None, False)
    joined, produce = cache.acquire("k", produce=False, salt="tenant-a")
    assert joined is not None and not produce
    assert cache.stats().inflight_dedups == 1
    cache.complete("k", _tensor(2))
    assert cache.release([producer.result(0).lease_id, joined.result(0).lease_id]) == 2


def test_producer_key_of_another_salt_is_refused_not_overwritten():
    # Never happens for real keys (they hash the salt); a collision must not swap tenants' entries.
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    h = _put_salted(cache, "k", 1, salt="tenant-a", owner="a")
    with pytest.raises(SaltClashError):
        cache.acquire("k", salt="tenant-b")
    assert cache.contains("k", "tenant-a") and not cache.contains("k", "tenant-b")
    assert cache.release([h.lease_id], owner="a") == 1


def test_release_frees_only_the_owners_leases():
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    alice = _put_salted(cache, "k", 1, salt="", owner="alice")
    anon = cache.acquire("k")[0].result(0)  # the empty owner: anonymous
    assert cache.stats().active_leases == 2
    # Another owner, or the anonymous one, frees nothing of alice's and is told 0, as for an unknown id.
    assert cache.release([alice.lease_id], owner="mallory") == 0
    assert cache.release([alice.lease_id]) == 0
    # An owner cannot free an anonymous lease either.
    assert cache.release([anon.lease_id], owner="alice") == 0
    s = cache.stats()
    assert (s.active_leases, s.leased_bytes) == (2, ITEM)
    assert cache.release([alice.lease_id, anon.lease_id, "unknown"], owner="alice") == 1
    assert cache.release([anon.lease_id], owner="") == 1
    assert cache.stats().active_leases == 0 and cache.stats().leased_bytes == 0


def test_leases_named_after_an_ask_are_released_by_its_owner_only():
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    first = _put_salted(cache, "k", 1, salt="", owner="alice")
    second = cache.acquire("k", owner="alice")[0].result(0)
    other = cache.acquire("k", owner="alice")[0].result(0)
    cache.name_leases([first.lease_id, second.lease_id], "req-1#0")
    cache.name_leases([other.lease_id], "req-1#1")
    assert cache.release_asks(["req-1#0"], owner="mallory") == 0  # another owner: nothing
    assert cache.release_asks(["req-1#0"], owner="") == 0  # the anonymous owner: never by ask
    assert cache.release_asks(["req-1#0", "unknown"], owner="alice") == 2
    assert cache.stats().active_leases == 1  # the other ask's lease stays
    assert cache.release([other.lease_id], owner="alice") == 1


def test_a_request_releases_every_ask_named_after_it_for_its_owner_only():
    """A decoder's asks are "R#n.k": its front end, once the engine core is gone, gives back every lease
    of request R by "R" alone (issue 67), and nothing of another request or another owner."""
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    first = _put_salted(cache, "k", 1, salt="", owner="alice")
    retry = cache.acquire("k", owner="alice")[0].result(0)
    unrelated = cache.acquire("k", owner="alice")[0].result(0)
    cache.name_leases([first.lease_id], "req-1#0.1")
    cache.name_leases([retry.lease_id], "req-1#2#0.2")  # a forked choice's ask
    cache.name_leases([unrelated.lease_id], "req-10#0.1")
    assert cache.release_asks(["req-1"], owner="mallory") == 0
    assert cache.release_asks(["req-1"], owner="alice") == 2
    assert cache.stats().active_leases == 1  # req-10's stays
    assert cache.release_asks(["req-10"], owner="alice") == 1


def test_waiters_leases_belong_to_their_own_owners():
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    f1, _ = cache.acquire("k", owner="one")
    f2, _ = cache.acquire("k", owner="two")  # joins the production
    cache.complete("k", _tensor(3))
    h1, h2 = f1.result(0), f2.result(0)
    assert cache.release([h1.lease_id, h2.lease_id], owner="one") == 1
    assert cache.release([h1.lease_id, h2.lease_id], owner="two") == 1


def test_foreign_owned_lease_still_expires():
    clock = FakeClock()
    cache = EmbeddingCache(TensorArena(ITEM), lease_ttl_s=5.0, clock=clock)
    h = _put_salted(cache, "k", 1, salt="", owner="alice")
    assert cache.release([h.lease_id], owner="mallory") == 0
    clock.t = 5.0
    s = cache.stats()
    assert (s.active_leases, s.expired_leases, s.leased_bytes) == (0, 1, 0)
    assert cache.release([h.lease_id], owner="alice") == 0


# -- a new lease pins its entry, however the entry got there (issue 19) ------------------------------


def _arena_bytes(cache: EmbeddingCache, handle) -> torch.Tensor:
    """A copy of the raw arena bytes under the handle's slice."""
    return cache.arena.view(handle.entry.offset, handle.entry.nbytes).clone()


def _pressure(cache: EmbeddingCache, n: int, seed0: int = 100) -> None:
    """Store n unleased entries, each of which must evict something once the arena is full."""
    for i in range(n):
        _put(cache, f"filler-{seed0 + i}", seed0 + i, want_lease=False)


def _assert_pinned_then_evictable(cache: EmbeddingCache, key: str, handle, seed: int, raw: torch.Tensor):
    """Under eviction pressure the leased entry stays, bytes unchanged; once released it goes."""
    evictions = cache.stats().evictions
    _pressure(cache, 6)  # the arena holds 3 items: every filler after the first evicts one
    assert cache.stats().evictions >= evictions + 4, "the pressure evicted nothing: the test proves nothing"
    assert cache.contains(key), "a leased entry was evicted"
    assert torch.equal(_arena_bytes(cache, handle), raw), "a leased entry's arena bytes were overwritten"
    assert torch.equal(cache.read(handle.entry), _tensor(seed))
    again = cache.lease(key)
    assert again is not None and again.entry.offset == handle.entry.offset
    assert cache.release([handle.lease_id, again.lease_id]) == 2
    _pressure(cache, 3, seed0=200)  # released: the entry is the LRU victim like any other
    assert not cache.contains(key)


def test_prefetched_entry_leased_on_hit_is_pinned():
    """An entry stored without a lease (a prefetch) and then leased by a hit leaves the evictable LRU:
    eviction pressure neither drops it nor rewrites its arena bytes."""
    cache = EmbeddingCache(TensorArena(3 * ITEM))
    prefetched = _put(cache, "p", 7, want_lease=False)
    assert not prefetched.lease_id
    fut, produce = cache.acquire("p")  # the demand request that follows the prefetch: a hit with a lease
    h = fut.result(0)
    assert not produce and h.hit and h.lease_id
    _assert_pinned_then_evictable(cache, "p", h, 7, _arena_bytes(cache, h))


@pytest.mark.parametrize("ask", ["after", "during", "lease"])
def test_production_for_an_ask_answers_that_ask_as_a_miss(ask):
    """A production started for a request that asks next (a decoder's file sent ahead, `for_ask`): that
    ask is a miss however it races the production (joined while it runs, or found ready, by acquire or
    by lease); the asks after it are hits. The production counts one miss and that ask no hit."""
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    fut, produce = cache.acquire("f", want_lease=False, for_ask=True)
    assert produce
    if ask == "during":
        joined, produce = cache.acquire("f", produce=False)
        assert not produce
    cache.complete("f", _tensor(3))
    if ask == "after":
        joined, _ = cache.acquire("f", produce=False)
    first = cache.lease("f") if ask == "lease" else joined.result(0)
    assert not first.hit and first.lease_id
    later, _ = cache.acquire("f", produce=False)
    assert later.result(0).hit and cache.lease("f").hit
    assert (cache.stats().hits, cache.stats().misses) == (2, 1)


def test_production_for_an_ask_joined_by_another_prefetch_still_owes_one_miss():
    """Two decoders sending the same file ahead share one production: one of their asks is the miss, the
    other a hit. A production not made for an ask (lookahead's, a client's Prefetch) owes none."""
    cache = EmbeddingCache(TensorArena(4 * ITEM))
    cache.acquire("f", want_lease=False, for_ask=True)
    cache.acquire("f", want_lease=False, for_ask=True)  # joins
    cache.complete("f", _tensor(4))
    hits = [cache.acquire("f", produce=False)[0].result(0).hit for _ in range(2)]
    assert hits == [False, True]
    cache.acquire("g", want_lease=False)
    cache.complete("g", _tensor(5))
    assert cache.acquire("g", produce=False)[0].result(0).hit


def test_production_for_an_ask_owes_no_miss_past_a_lease_ttl():
    """The request a file was sent ahead for may never ask (cancelled, or its KV was cached): an ask after
    a lease's TTL is somebody else's, and a hit."""
    clock = FakeClock()
    cache = EmbeddingCache(TensorArena(4 * ITEM), lease_ttl_s=10.0, clock=clock)
    cache.acquire("f", want_lease=False, for_ask=True)
    cache.complete("f", _tensor(6))
    clock.t = 10.0
    assert cache.acquire("f", produce=False)[0].result(0).hit


def test_prefetched_entry_leased_by_lease_call_is_pinned():
    """The same through `lease()` (the hash-only path): the new lease pins an unleased entry."""
    cache = EmbeddingCache(TensorArena(3 * ITEM))
    _put(cache, "p", 8, want_lease=False)
    h = cache.lease("p")
    assert h is not None and h.lease_id
    _assert_pinned_then_evictable(cache, "p", h, 8, _arena_bytes(cache, h))


def test_entry_leased_again_after_all_leases_released_is_pinned():
    """An entry whose leases were all released is evictable again; a later lease must pin it anew."""
    cache = EmbeddingCache(TensorArena(3 * ITEM))
    first, second = _put(cache, "r", 9), cache.lease("r")
    assert cache.release([first.lease_id, second.lease_id]) == 2
    assert cache.stats().leased_bytes == 0
    fut, produce = cache.acquire("r")
    h = fut.result(0)
    assert not produce and h.hit and cache.stats().leased_bytes == ITEM
    _assert_pinned_then_evictable(cache, "r", h, 9, _arena_bytes(cache, h))


@pytest.mark.parametrize("producer_leases", [False, True], ids=["prefetch-producer", "leased-producer"])
def test_lease_taken_by_joining_an_inflight_encode_is_pinned(producer_leases):
    """A request that joins an encode in flight gets its lease when the entry is stored: pinned from then
    on, whether the producer itself held a lease (and releases it first) or was a prefetch."""
    cache = EmbeddingCache(TensorArena(3 * ITEM))
    producer, produce = cache.acquire("j", want_lease=producer_leases)
    joiner, joined_produce = cache.acquire("j")
    assert produce and not joined_produce and cache.stats().inflight_dedups == 1
    cache.complete("j", _tensor(11))
    p, h = producer.result(0), joiner.result(0)
    assert h.lease_id and not h.hit and bool(p.lease_id) == producer_leases
    if producer_leases:
        assert cache.release([p.lease_id]) == 1
    assert cache.stats().active_leases == 1
    _assert_pinned_then_evictable(cache, "j", h, 11, _arena_bytes(cache, h))
