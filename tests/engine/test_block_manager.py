"""Block manager: image-aware block hashes, salts, LRU eviction, ref counts, hit rules."""

from __future__ import annotations

from decoder_svc.engine.block_manager import BlockManager, FreeBlockQueue, KVBlock
from decoder_svc.engine.request import ImagePlaceholder, Request
from decoder_svc.engine.sampling_params import SamplingParams

BS = 16


def _req(rid: str, n_tokens: int = 64, image_hash: str | None = "h1", offset: int = 20,
         salt: str = "") -> Request:
    tokens = [100 + (i % 50) for i in range(n_tokens)]
    images = []
    if image_hash is not None:
        tokens[offset:offset + 16] = [4] * 16
        images = [ImagePlaceholder(offset=offset, length=16, content_hash=image_hash)]
    return Request(rid, tokens, SamplingParams(), max_tokens=1, images=images, cache_salt=salt)


def _fill(bm: BlockManager, req: Request) -> None:
    """Allocate and "compute" the whole prompt, then free it (its full blocks stay cached)."""
    assert bm.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.free(req)


def test_identical_request_hits_all_but_last_token():
    bm = BlockManager(16, BS)
    _fill(bm, _req("a"))
    hit = bm.find_cached_prefix(_req("b"))
    assert len(hit) == (64 - 1) // BS  # never the last token: 3 blocks, not 4


def test_exact_block_multiple_leaves_last_block_uncached():
    bm = BlockManager(16, BS)
    _fill(bm, _req("a", n_tokens=32, image_hash=None))
    assert len(bm.find_cached_prefix(_req("b", n_tokens=32, image_hash=None))) == 1


def test_different_image_reuses_nothing_past_image_start():
    bm = BlockManager(16, BS)
    _fill(bm, _req("a", image_hash="h1", offset=20))
    hit = bm.find_cached_prefix(_req("b", image_hash="h2", offset=20))
    assert len(hit) * BS <= 20 and len(hit) == 1  # the block [0, 16) only: [16, 32) holds the image


def test_image_keys_carry_offset_within_image():
    bm = BlockManager(16, BS)
    a = _req("a", offset=20)
    ha = bm.block_hashes(a)
    assert ha == bm.block_hashes(_req("a2", offset=20))
    # Same tokens, same image, but the request claims the image sits elsewhere: block 2 then holds
    # other rows of the image, so its key (and every later hash) must differ.
    c = _req("c", offset=20)
    c.images[0] = ImagePlaceholder(offset=18, length=16, content_hash="h1")
    hc = bm.block_hashes(c)
    assert hc[0] == ha[0] and hc[2] != ha[2] and hc[3] != ha[3]


def test_same_image_other_salt_reuses_nothing():
    bm = BlockManager(16, BS)
    _fill(bm, _req("a", salt="tenant-1"))
    assert bm.find_cached_prefix(_req("b", salt="tenant-2")) == []
    assert bm.find_cached_prefix(_req("c", salt="")) == []
    assert len(bm.find_cached_prefix(_req("d", salt="tenant-1"))) == 3


def test_tokens_are_compared_on_hit():
    bm = BlockManager(16, BS)
    _fill(bm, _req("a"))
    block = bm.cached[bm.block_hashes(_req("x"))[0]]
    block.token_ids = (0,) * BS  # a forged collision: same hash, other tokens
    assert bm.find_cached_prefix(_req("b")) == []


def test_ref_counts_and_release():
    bm = BlockManager(16, BS)
    a, b = _req("a"), _req("b")
    assert bm.allocate_slots(a, 64)
    a.num_computed_tokens = 64
    hit = bm.find_cached_prefix(b)
    assert bm.allocate_slots(b, 64 - len(hit) * BS, hit)
    assert [blk.ref_cnt for blk in hit] == [2, 2, 2]
    assert bm.stats().used_blocks == 5  # 4 of a + 1 new of b
    bm.free(a)
    assert bm.stats().used_blocks == 4
    bm.free(b)
    s = bm.stats()
    assert s.used_blocks == 0 and s.cached_free_blocks == 4


def test_lru_eviction_takes_least_recent_and_tail_first():
    bm = BlockManager(5, BS)
    _fill(bm, _req("a", image_hash=None))  # 4 cached blocks, 1 empty
    other = _req("o", n_tokens=32, image_hash=None)
    other.prompt_token_ids = [7] * 32
    assert bm.allocate_slots(other, 32)  # takes the empty block, then evicts a's tail block
    assert len(bm.find_cached_prefix(_req("b", image_hash=None))) == 3  # 3 first blocks survive
    assert bm.stats().used_blocks == 2


def test_allocation_failure_changes_nothing():
    bm = BlockManager(3, BS)
    r = _req("a", image_hash=None)
    assert not bm.allocate_slots(r, 64)
    assert bm.stats().used_blocks == 0 and bm.block_table(r) == []


def test_free_queue_is_o1_linked_list():
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.appendleft(blocks[2])
    assert [q.popleft().block_id for _ in range(len(q))] == [2, 0, 1, 3]
