"""The deterministic mode's kernels (common/kernels/invariant_matmul.py, paged_attention's `invariant`) in
Triton's interpreter: a row's result is the same bits whatever the batch's other rows, its sequence's other
chunks and the key tiles past it, and equals the plain computation up to rounding.

The interpreter's dot is numpy's, whose sums depend on a row's place inside a tile (BLAS edge kernels), so
the rows compared here keep their place in the tile; on a GPU a tensor-core product sums every row alike,
and tests/gpu/test_deterministic_gpu.py compares rows at other places too, compiled."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from common.kernels.attention import paged_attention  # noqa: E402
from common.kernels.invariant_matmul import invariant_matmul  # noqa: E402
from decoder_svc.model.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402
from decoder_svc.model.batch_invariant import invariant_mm  # noqa: E402


def test_invariant_matmul_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    x, w, bias = torch.randn(130, 48), torch.randn(80, 48), torch.randn(80)
    full = invariant_matmul(x, w.t(), bias)
    for m in (1, 2, 5, 17, 64, 65):  # the first m rows: the same places in the same tiles
        assert torch.equal(invariant_matmul(x[:m], w.t(), bias), full[:m]), m
    assert torch.equal(invariant_matmul(x[64:], w.t(), bias), full[64:])  # a tile's rows without the first
    torch.testing.assert_close(full, x @ w.t() + bias, atol=1e-4, rtol=1e-4)
    assert invariant_matmul(x[:0], w.t()).shape == (0, 80)
    with pytest.raises(ValueError, match="one dtype"):
        invariant_matmul(x, w.t().double())


def test_cpu_invariant_mm_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    x, w = torch.randn(300, 64), torch.randn(192, 64)
    full = invariant_mm(x, w.t())
    for m in range(1, 40):
        assert torch.equal(invariant_mm(x[:m], w.t()), full[:m]), m


@pytest.mark.parametrize("window", [None, 5])
def test_invariant_attention_a_row_is_the_same_whole_chunked_or_decoding(window):
    torch.manual_seed(0)
    heads, kv_heads, dim, page, length = 4, 2, 16, 4, 37
    blocks = -(-length // page)
    kv = torch.randn(2, blocks + 4, page, kv_heads, dim)
    q_all = torch.randn(length, heads, dim)
    table, other = list(range(4, 4 + blocks)), [0, 1, 2]

    def attend(q, query_lens, seq_lens, tables):
        meta = AttentionMetadata.build([-1] * q.shape[0], query_lens, seq_lens, tables, page, "cpu")
        return paged_attention(q, kv, meta, dim ** -0.5, window=window, invariant=True)

    whole = attend(q_all, [length], [length], [table])
    meta = AttentionMetadata.build([-1] * length, [length], [length], [table], page, "cpu")
    reference = TorchAttentionBackend()._one_sequence(q_all, kv, meta.block_tables[0], length, page,
                                                      dim ** -0.5, window)
    torch.testing.assert_close(whole, reference, atol=1e-5, rtol=1e-5)
    # A q-block is 32 tokens here (64 rows / 2 heads a KV head): a chunk from token 32 keeps its rows'
    # places, over the cached keys before it and beside another sequence.
    q_other = torch.randn(5, heads, dim)
    chunk = attend(torch.cat((q_other, q_all[32:])), [5, length - 32], [9, length], [other, table])[5:]
    assert torch.equal(chunk, whole[32:])
    # token 32 decoding among other sequences' decodes (its keys end at 33: a shorter walk of the tiles)
    decode = attend(torch.cat((q_other[:2], q_all[32:33])), [1, 1, 1], [9, 6, 33], [other, other, table])
    assert torch.equal(decode[2:], whole[32:33])


def test_invariant_attention_refuses_splits():
    kv = torch.zeros(2, 2, 4, 1, 16)
    meta = AttentionMetadata.build([-1], [1], [3], [[0]], 4, "cpu")
    with pytest.raises(ValueError, match="one split"):
        paged_attention(torch.zeros(1, 1, 16), kv, meta, 1.0, num_splits=2, invariant=True)
