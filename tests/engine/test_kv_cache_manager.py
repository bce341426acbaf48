"""KV cache manager over a full and a sliding-window group: blocks freed as the window moves, prefix hits
with partially evicted sliding blocks, allocation that fails atomically, the pool split rule."""

from __future__ import annotations

from decoder_svc.engine.block_manager import BlockManager
from decoder_svc.engine.kv_cache_manager import KVCacheManager
from decoder_svc.engine.request import Request
from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.engine.sliding_block_manager import SlidingWindowBlockManager, first_visible_block
from decoder_svc.model.kv_groups import KVCacheGroup, sliding_bound, split_kv_blocks

BS, WINDOW = 4, 10


def _req(rid: str, n: int = 40, offset: int = 0) -> Request:
    return Request(rid, [100 + (i + offset) % 50 for i in range(n)], SamplingParams(), max_tokens=1)


def _manager(full: int = 32, sliding: int = 32, caching: bool = True) -> KVCacheManager:
    return KVCacheManager([BlockManager(full, BS, caching),
                           SlidingWindowBlockManager(sliding, WINDOW, BS, caching)])


def _compute(m: KVCacheManager, req: Request, chunk: int) -> None:
    """Schedule the request's prompt in chunks, as the scheduler does (allocate, then advance)."""
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert m.allocate_slots(req, n)
        req.num_computed_tokens += n


def test_first_visible_block() -> None:
    # A query at 12 sees keys > 2: block 0 (0..3) still holds key 3.
    assert first_visible_block(12, WINDOW, BS) == 0
    assert first_visible_block(13, WINDOW, BS) == 1  # keys > 3: block 0 is gone
    assert first_visible_block(5, WINDOW, BS) == 0


def test_sliding_blocks_freed_as_the_window_moves() -> None:
    m = _manager()
    req = _req("a")
    sliding = m.pools[1]
    for _ in range(10):  # 4-token chunks: the table stays logical, old entries become the null block
        n = min(4, req.num_tokens - req.num_computed_tokens)
        assert m.allocate_slots(req, n)
        start = req.num_computed_tokens
        table = m.block_tables(req)[1]
        first = first_visible_block(start, WINDOW, BS)
        assert len(table) == len(m.block_tables(req)[0]) == -(-(start + n) // BS)
        assert table[:first] == [0] * first and 0 not in table[first:]
        assert m.num_held_blocks(req)[1] <= -(-(WINDOW + 4) // BS) + 1
        req.num_computed_tokens += n
    # full: all 40 tokens; sliding: blocks 6..9 for the last chunk's queries (36..39 see keys > 26)
    assert m.num_held_blocks(req) == [10, 4]
    assert sliding.stats().used_blocks == 4
    m.free(req)
    assert m.stats().used_blocks == 0 and all(s.used_blocks == 0 for s in m.group_stats())
    # Freed-by-window blocks were registered (cached) before: they wait in the free queue, reusable.
    assert sliding.stats().cached_free_blocks == 10


def test_freed_blocks_are_reused_by_the_same_allocation() -> None:
    """A pool of exactly one window plus a chunk serves a long prompt: each allocation frees first."""
    need = -(-(WINDOW + 4) // BS) + 1
    m = _manager(full=16, sliding=need)
    req = _req("a", n=60)
    _compute(m, req, 4)
    assert req.num_computed_tokens == 60


def test_hit_needs_only_the_window_of_the_sliding_group() -> None:
    m = _manager()
    a = _req("a")
    _compute(m, a, 40)  # one chunk: every sliding block held until the end, so all of them get cached
    m.free(a)
    hit = m.find_cached_prefix(_req("b"))
    assert len(hit) == (40 - 1) // BS == 9
    first = first_visible_block(36, WINDOW, BS)  # a query at 36 sees keys > 26: blocks 6..8
    assert [b.block_id for b in hit.tables[1][:first]] == [0] * first
    assert all(b.block_id != 0 for b in hit.tables[1][first:])
    b = _req("b")
    assert m.allocate_slots(b, 4, hit)
    assert m.num_held_blocks(b) == [10, 10 - first]


def test_hit_search_skips_evicted_sliding_blocks_from_the_right() -> None:
    m = _manager()
    _compute(m, _req("a"), 40)
    m.free(_req("a"))
    sliding = m.pools[1]
    # Evict sliding block 7 (tokens 28..31): hits of 8 or 9 blocks would see it; 7 blocks (a query at 28
    # sees keys > 18: blocks 4..6) do not.
    hashes = sliding.block_hashes(_req("b"), 40)
    block = sliding.cached[hashes[7]]
    sliding.free_queue.remove(block)
    sliding._evict(block)
    sliding.free_queue.appendleft(block)
    hit = m.find_cached_prefix(_req("b"))
    assert len(hit) == 7
    # Evict block 4 as well: 7 needs it; 6 (query at 24: keys > 14, blocks 3..5) too; 5 (keys > 10:
    # blocks 2..4) too; 4 (keys > 6: blocks 1..3) does not.
    block = sliding.cached[hashes[4]]
    sliding.free_queue.remove(block)
    sliding._evict(block)
    sliding.free_queue.appendleft(block)
    assert len(m.find_cached_prefix(_req("b"))) == 4
    # The full group limits the hit too: a different tail keeps only the shared blocks.
    assert len(m.find_cached_prefix(_req("c", offset=17))) == 0


def test_allocation_fails_atomically_when_one_group_is_short() -> None:
    m = _manager(full=32, sliding=2)  # the sliding pool cannot hold a 12-token chunk's 3 blocks
    req = _req("a")
    before = (m.pools[0].num_free_blocks, m.pools[1].num_free_blocks)
    assert not m.allocate_slots(req, 12)
    assert (m.pools[0].num_free_blocks, m.pools[1].num_free_blocks) == before
    assert m.block_tables(req) == [[], []]
    m2 = _manager(full=2, sliding=32)  # and the other way round
    assert not m2.allocate_slots(req, 12)
    assert m2.pools[1].num_free_blocks == 32 and m2.stats().used_blocks == 0


def test_one_group_is_the_plain_block_manager() -> None:
    """A model without sliding layers: the same block ids and stats as a bare BlockManager."""
    m = KVCacheManager([BlockManager(16, BS)])
    bare = BlockManager(16, BS)
    for pool in (m, bare):
        a = _req("a", n=20)
        _compute(pool, a, 7)
        pool.free(a)
    b1, b2 = _req("b", n=20), _req("b", n=20)
    h1, h2 = m.find_cached_prefix(b1), bare.find_cached_prefix(b2)
    assert len(h1) == len(h2) == 4
    assert m.allocate_slots(b1, 4, h1) and bare.allocate_slots(b2, 4, h2)
    assert m.block_tables(b1) == [bare.block_table(b2)]
    assert m.stats() == bare.stats()


def test_split_rule_gives_the_full_group_what_the_window_does_not_need() -> None:
    groups = [KVCacheGroup((5,), None), KVCacheGroup((0, 1, 2, 3, 4), 16)]
    bound = sliding_bound(16, 4, max_num_seqs=2, max_tokens=8)
    assert bound == 2 * (6 + 2)
    full, sliding = split_kv_blocks(groups, total=100, block_size=4, max_num_seqs=2, max_tokens=8)
    assert sliding.num_blocks == bound
    assert full.num_blocks == (100 * 6 - 5 * bound) // 1
    assert full.num_blocks * 1 + sliding.num_blocks * 5 <= 100 * 6
    # A tiny budget: no gain, the sliding group gets no more than the full one.
    full, sliding = split_kv_blocks(groups, total=10, block_size=4, max_num_seqs=2, max_tokens=8)
    assert (full.num_blocks, sliding.num_blocks) == (10, 10)
    assert split_kv_blocks(groups[:1], 7, 4, 2, 8)[0].num_blocks == 7
