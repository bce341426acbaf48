"""A sliding-window group's tables name a placeholder (the null block) where the window freed a block:
attention over such tables equals attention over the full tables, for the torch reference and for
Triton (which may read the placeholder for a key tile straddling the window's start: masked out). The
placeholder here holds finite garbage rather than the runtime's zeros, so reading it unmasked would show.
On a CPU host Triton runs in its interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from decoder_svc.engine.sliding_block_manager import first_visible_block
from decoder_svc.model.attention import AttentionMetadata, TorchAttentionBackend
from tests.engine.test_triton_attention import random_batch

CASES = [
    # seq_lens, query_lens, heads, kv_heads, dim, page, window
    ([40, 23, 9, 31], [1, 1, 1, 6], 4, 2, 16, 4, 10),     # decode rows and a chunk, 4-token pages
    ([90, 70], [20, 1], 4, 4, 16, 8, 16),                  # a chunk longer than the window's start tile
    ([130, 66], [1, 30], 8, 2, 32, 16, 33),                # the window off a page boundary
]


def null_tables(meta: AttentionMetadata, seq_lens: list[int], query_lens: list[int], page: int,
                window: int, null: int) -> list[list[int]]:
    """Each sequence's table with the blocks before its first query's window replaced by `null`."""
    tables = []
    for i, (n, nq) in enumerate(zip(seq_lens, query_lens, strict=True)):
        table = meta.block_tables[i, :-(-n // page)].tolist()
        first = first_visible_block(n - nq, window, page)
        tables.append([null] * first + table[first:])
    return tables


def run_both(seq_lens, query_lens, heads, kv_heads, dim, page, window, backend):
    q, k, v, kv_cache, meta = random_batch(seq_lens, query_lens, heads, kv_heads, dim, page, seed=window)
    scale = dim ** -0.5
    want = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), meta, scale, window=window)
    null = kv_cache.shape[1]
    garbage = torch.full((2, 1, *kv_cache.shape[2:]), 7.0)
    cache = torch.cat([kv_cache, garbage], dim=1)
    tables = null_tables(meta, seq_lens, query_lens, page, window, null)
    assert any(null in t for t in tables)
    sliding = AttentionMetadata.build(meta.slot_mapping.tolist(), query_lens, seq_lens, tables, page, "cpu")
    got = backend.forward(q, k, v, cache, sliding, scale, window=window)
    assert torch.equal(cache[:, null], garbage[:, 0])  # never written
    return got, want


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_reference_ignores_freed_entries(case) -> None:
    got, want = run_both(*case, backend=TorchAttentionBackend())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_triton_ignores_freed_entries(case) -> None:
    pytest.importorskip("triton")
    from decoder_svc.model.kernel_dispatch import TritonAttentionBackend

    got, want = run_both(*case, backend=TritonAttentionBackend(num_sms=4))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
