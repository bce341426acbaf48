"""The Triton paged-attention and KV-store kernels equal the torch reference backend on random batches
that mix prefill chunks over a cached prefix with decode rows (GQA, odd page sizes, split keys).

On a CPU host they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); tests/gpu
repeats them compiled, at real sizes.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from common.kernels.attention import paged_attention  # noqa: E402
from common.kernels.kv_store import store_kv  # noqa: E402
from decoder_svc.model.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402


def random_batch(seq_lens, query_lens, heads, kv_heads, dim, page, dtype=torch.float32, device="cpu", seed=0,
                 pad_seqs=0):
    """A KV pool with scattered blocks, each sequence's prefix already stored, and new q/k/v."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = sum(-(-n // page) for n in seq_lens)
    num_blocks = blocks_needed + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for n, nq in zip(seq_lens, query_lens, strict=True):
        table = [perm.pop() for _ in range(-(-n // page))]
        tables.append(table)
        slots += [table[p // page] * page + p % page for p in range(n - nq, n)]
    for _ in range(pad_seqs):  # CUDA-graph padding: a one-token row with no slot and no context
        tables.append([])
        slots.append(-1)
    query_lens = list(query_lens) + [1] * pad_seqs
    seq_lens = list(seq_lens) + [0] * pad_seqs
    kv_cache = (torch.randn(2, num_blocks, page, kv_heads, dim, generator=g) * 2).to(dtype).to(device)
    total = sum(query_lens)
    q = (torch.randn(total, heads, dim, generator=g) * 2).to(dtype).to(device)
    k = torch.randn(total, kv_heads, dim, generator=g).to(dtype).to(device)
    v = torch.randn(total, kv_heads, dim, generator=g).to(dtype).to(device)
    meta = AttentionMetadata.build(slots, query_lens, seq_lens, tables, page, device)
    return q, k, v, kv_cache, meta


CASES = [
    # seq_lens, query_lens, heads, kv_heads, dim, page
    ([5, 1, 9, 13, 7], [1, 1, 3, 1, 1], 4, 2, 16, 4),        # decode rows around one chunk
    ([40, 17], [40, 5], 4, 4, 16, 16),                         # a whole prompt; a chunk over a prefix
    ([70, 3, 33], [20, 3, 1], 8, 2, 32, 8),                    # GQA 4, chunk longer than a q-block
    ([100], [1], 6, 2, 16, 16),                                # one long decode (split keys)
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_equals_reference(case, splits):
    seq_lens, query_lens, heads, kv_heads, dim, page = case
    q, k, v, kv_cache, meta = random_batch(seq_lens, query_lens, heads, kv_heads, dim, page, seed=splits)
    scale = dim ** -0.5
    ref_cache = kv_cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, scale)
    cache = kv_cache.clone()
    store_kv(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache, ref_cache)  # the store wrote exactly the reference's slots
    out = paged_attention(q, cache, meta, scale, num_splits=splits)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_short_chunks_over_a_long_prefix_split_their_keys_and_big_batches_do_not():
    from decoder_svc.model.kernel_dispatch import TritonAttentionBackend

    backend = TritonAttentionBackend(num_sms=132)
    # Qwen2.5-VL-7B's heads: 28 query heads over 4 KV heads (64-row tiles of 9 tokens).
    for query_lens, seq_lens, split in (([11], [1700], True),   # a prefix hit's last tokens
                                        ([1], [1700], True),    # one decode
                                        ([600], [600], False),  # a prompt chunk: enough programs
                                        ([1] * 40, [100] * 40, False)):  # many decodes
        q, _, _, cache, meta = random_batch(seq_lens, query_lens, 28, 4, 16, 16)
        assert (backend.num_splits(q, cache, meta) > 1) == split, (query_lens, seq_lens)
    q, _, _, cache, meta = random_batch([1700], [11], 28, 4, 16, 16)
    assert backend.num_splits(q, cache, meta) == 16


def test_padded_rows_are_skipped_and_zero():
    q, k, v, kv_cache, meta = random_batch([6, 9], [1, 1], 4, 2, 16, 4, pad_seqs=2)
    cache = kv_cache.clone()
    store_kv(k, v, cache, meta.slot_mapping)
    real = meta.slot_mapping[:2]
    flat, ref_flat = cache.view(2, -1, 2, 16), kv_cache.clone().view(2, -1, 2, 16)
    ref_flat[0, real], ref_flat[1, real] = k[:2], v[:2]
    assert torch.equal(flat, ref_flat)  # padding (slot -1) wrote nothing
    for splits in (1, 2):
        out = paged_attention(q, cache, meta, 16 ** -0.5, num_splits=splits)
        assert torch.equal(out[2:], torch.zeros_like(out[2:]))
        assert torch.isfinite(out).all()
    # A chunk padded like a CUDA graph's mixed step, its keys split.
    q, k, v, kv_cache, meta = random_batch([40, 9], [7, 1], 4, 2, 16, 4, pad_seqs=3)
    ref = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), meta, 0.25)
    store_kv(k, v, kv_cache, meta.slot_mapping)
    out = paged_attention(q, kv_cache, meta, 0.25, num_splits=4)
    torch.testing.assert_close(out[:8], ref[:8], rtol=1e-4, atol=1e-4)
    assert torch.equal(out[8:], torch.zeros_like(out[8:]))


@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window"])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_only_batches_find_their_rows_without_a_search(window, splits):
    """A batch of one-row sequences (a decode graph's shape, padding rows included) takes the kernel's
    decode path: program i reads row i of sequence i, no query_start_loc search."""
    seq_lens = [5, 1, 17, 33, 9, 64]
    q, k, v, kv_cache, meta = random_batch(seq_lens, [1] * 6, 8, 2, 16, 4, seed=splits, pad_seqs=2)
    assert meta.max_query_len == 1 and q.shape[0] == meta.num_seqs
    ref = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), meta, 0.25, window=window)
    store_kv(k, v, kv_cache, meta.slot_mapping)
    out = paged_attention(q, kv_cache, meta, 0.25, num_splits=splits, window=window)
    torch.testing.assert_close(out[:6], ref[:6], rtol=1e-4, atol=1e-4)
    assert torch.equal(out[6:], torch.zeros_like(out[6:]))  # padding rows: no context, zeros


@pytest.mark.parametrize("block_n", [16, 32, 128])
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["mixed", "long-decode"])
def test_other_key_tiles_equal_reference(case, block_n):
    """bench.attention sweeps the key tile (warps and stages too, which the interpreter ignores) and the
    programs' order: each gives the reference's result, split or not, heads first or sequences first."""
    from common.kernels.attention import AttentionTiles

    seq_lens, query_lens, heads, kv_heads, dim, page = case
    q, k, v, kv_cache, meta = random_batch(seq_lens, query_lens, heads, kv_heads, dim, page, seed=block_n)
    ref = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), meta, dim ** -0.5)
    store_kv(k, v, kv_cache, meta.slot_mapping)
    for splits, heads_first in ((1, True), (4, True), (1, False), (4, False)):
        tiles = AttentionTiles(block_n, num_warps=2, num_stages=3, heads_first=heads_first)
        out = paged_attention(q, kv_cache, meta, dim ** -0.5, num_splits=splits, tiles=tiles)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_more_query_blocks_than_the_grids_second_axis_takes_go_sequences_first(monkeypatch):
    from common.kernels import attention

    monkeypatch.setattr(attention, "_MAX_GRID_Y", 2)  # CUDA's is 65535: a prefill of ~4M tokens
    seq_lens, query_lens, heads, kv_heads, dim, page = CASES[2]
    q, k, v, kv_cache, meta = random_batch(seq_lens, query_lens, heads, kv_heads, dim, page, seed=5)
    ref = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), meta, dim ** -0.5)
    store_kv(k, v, kv_cache, meta.slot_mapping)
    out = paged_attention(q, kv_cache, meta, dim ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
