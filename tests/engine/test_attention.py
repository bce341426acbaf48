"""The batched decode path of the reference attention backend equals the per-sequence path, with and
without a sliding window; the window keeps each query's last `window` keys (HF's key > query - window)."""

from __future__ import annotations

import pytest
import torch

from decoder_svc.model.attention import AttentionMetadata, TorchAttentionBackend, write_kv


@pytest.mark.parametrize("window", [None, 3, 6])
def test_batched_decode_rows_equal_one_sequence_at_a_time(window):
    torch.manual_seed(0)
    block_size, heads, kv_heads, dim, num_blocks = 4, 4, 2, 8, 32
    seq_lens = [5, 1, 9, 13, 7]          # the 9-token one is a 3-token prefill chunk, the rest decode
    query_lens = [1, 1, 3, 1, 1]
    tables = torch.zeros(len(seq_lens), 4, dtype=torch.int64)
    slots = []
    for i, (n, nq) in enumerate(zip(seq_lens, query_lens, strict=True)):
        blocks = torch.randperm(num_blocks)[: -(-n // block_size)]  # scattered, possibly shared ids
        tables[i, : len(blocks)] = blocks
        slots += [int(blocks[p // block_size]) * block_size + p % block_size for p in range(n - nq, n)]
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim)
    total = sum(query_lens)
    q = torch.randn(total, heads, dim)
    k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    meta = AttentionMetadata.build(slots, query_lens, seq_lens, tables.tolist(), block_size, "cpu")
    backend = TorchAttentionBackend()
    batched = backend.forward(q, k, v, kv_cache.clone(), meta, scale=dim**-0.5, window=window)

    cache = kv_cache.clone()
    write_kv(k, v, cache, meta.slot_mapping)
    starts = meta.query_start_loc_cpu.tolist()
    for i, n in enumerate(seq_lens):
        ref = backend._one_sequence(q[starts[i]:starts[i + 1]], cache, tables[i], n, block_size, dim**-0.5,
                                    window)
        torch.testing.assert_close(batched[starts[i]:starts[i + 1]], ref, rtol=1e-5, atol=1e-6)


def test_window_keeps_the_last_keys():
    """A 5-token chunk at positions 7..11 of a 12-token context, window 4: query p sees keys p-3..p."""
    torch.manual_seed(1)
    block_size, heads, dim, n, nq, window = 4, 2, 8, 12, 5, 4
    kv_cache = torch.randn(2, 3, block_size, heads, dim)
    q = torch.randn(nq, heads, dim)
    out = TorchAttentionBackend()._one_sequence(q, kv_cache, torch.arange(3), n, block_size, 1.0, window)
    keys, values = kv_cache[0].reshape(n, heads, dim), kv_cache[1].reshape(n, heads, dim)
    for j in range(nq):
        p = n - nq + j
        lo = p - window + 1
        weights = torch.einsum("hd,khd->hk", q[j], keys[lo:p + 1]).softmax(-1)
        torch.testing.assert_close(out[j], torch.einsum("hk,khd->hd", weights, values[lo:p + 1]))
