"""Multi-part embeddings [parts, rows, hidden] in the cache and the importer, without a tower: one entry,
one slice, its bytes counted once (all parts) against the budget; refs that do not add up are refused."""

from __future__ import annotations

import pytest
import torch

from common.pb import common_pb2
from common.transport import import_embedding
from common.transport.arena import TensorArena
from encoder_svc.cache import CacheFullError, EmbeddingCache
from encoder_svc.refs import build_ref, inline_payload

PARTS, ROWS, HIDDEN = 4, 16, 32
NBYTES = PARTS * ROWS * HIDDEN * 4  # 8 KiB: a multiple of the arena's alignment


def _parts(seed: int) -> torch.Tensor:
    """A [parts, rows, hidden] embedding that is a non-contiguous view, as the tower's split gives."""
    whole = torch.randn(PARTS, 3 * ROWS, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return whole[:, ROWS:2 * ROWS]


def _put(cache: EmbeddingCache, key: str, seed: int, want_lease: bool = True):
    fut, produce = cache.acquire(key, want_lease, expected_nbytes=NBYTES)
    assert produce
    cache.complete_many([(key, _parts(seed))], [(1, 8, 8)])
    return fut.result(0)


def test_one_entry_holds_every_part_and_the_budget_counts_them_all():
    cache = EmbeddingCache(TensorArena(2 * NBYTES))  # room for exactly two images
    a = _put(cache, "a", 1)
    assert a.entry.shape == (PARTS, ROWS, HIDDEN) and a.entry.nbytes == NBYTES and a.entry.grid == (1, 8, 8)
    assert torch.equal(cache.read(a.entry), _parts(1))
    assert cache.stats().leased_bytes == NBYTES
    _put(cache, "b", 2, want_lease=False)
    assert cache.stats().bytes_used == 2 * NBYTES
    with pytest.raises(CacheFullError):  # all four parts of "a" are pinned by its lease
        cache.acquire("big", expected_nbytes=NBYTES + 1)
    _put(cache, "c", 3, want_lease=False)  # evicts "b" whole, never a part of "a"
    stats = cache.stats()
    assert stats.evictions == 1 and stats.entries == 2 and not cache.contains("b")
    assert torch.equal(cache.read(a.entry), _parts(1))
    assert cache.release([a.lease_id]) == 1 and cache.stats().leased_bytes == 0


def test_inline_ref_imports_as_parts_rows_hidden():
    cache = EmbeddingCache(TensorArena(NBYTES))
    handle = _put(cache, "a", 4)
    data = inline_payload(cache.read(handle.entry))
    ref = build_ref(handle, common_pb2.TRANSPORT_INLINE, cache.arena, data)
    assert list(ref.shape) == [PARTS, ROWS, HIDDEN] and ref.nbytes == len(data) == NBYTES
    assert list(ref.grid_thw) == [1, 8, 8]
    out = import_embedding(ref)
    assert out.shape == (PARTS, ROWS, HIDDEN) and torch.equal(out, _parts(4))
    assert torch.equal(out[2], _parts(4)[2])  # part-major: part p is rows*hidden contiguous values
    cache.release([handle.lease_id])


@pytest.mark.parametrize("shape", [[PARTS, ROWS + 1, HIDDEN], [PARTS, 0, HIDDEN], []])
def test_a_shape_that_does_not_match_nbytes_is_refused(shape):
    ref = common_pb2.EmbeddingRef(shape=shape, dtype=common_pb2.DTYPE_FLOAT32, nbytes=NBYTES,
                                  inline_data=bytes(NBYTES))
    with pytest.raises(ValueError, match="embedding shape"):
        import_embedding(ref)
