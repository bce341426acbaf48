"""The batched decode path of the reference attention backend equals the per-sequence path."""

from __future__ import annotations

import torch

from decoder_svc.model.attention import AttentionMetadata, TorchAttentionBackend, write_kv


def test_batched_decode_rows_equal_one_sequence_at_a_time():
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
    batched = backend.forward(q, k, v, kv_cache.clone(), meta, scale=dim**-0.5)

    cache = kv_cache.clone()
    write_kv(k, v, cache, meta.slot_mapping)
    starts = meta.query_start_loc_cpu.tolist()
    for i, n in enumerate(seq_lens):
        ref = backend._one_sequence(q[starts[i]:starts[i + 1]], cache, tables[i], n, block_size, dim**-0.5)
        torch.testing.assert_close(batched[starts[i]:starts[i + 1]], ref, rtol=1e-5, atol=1e-6)
