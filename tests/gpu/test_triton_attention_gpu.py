"""The Triton paged-attention kernels, compiled on the GPU, against the torch reference at real shapes:
llava-1.5-7b heads (32 x 128, no GQA) and GQA 4 and 8, page sizes 16 and 32, long contexts, prefill
chunks over a cached prefix mixed with decode rows, split keys; fp32 (IEEE dots) and bf16."""

from __future__ import annotations

import pytest
import torch

from decoder_svc.model.attention import TorchAttentionBackend
from decoder_svc.model.triton_attention import TritonAttentionBackend, paged_attention, store_kv
from tests.engine.test_triton_attention import random_batch

pytestmark = pytest.mark.gpu

SHAPES = [
    # seq_lens, query_lens, heads, kv_heads, dim, page
    ([1500, 3000, 17, 600], [1, 1, 1, 600], 32, 32, 128, 16),
    ([4000] * 3, [1] * 3, 32, 8, 128, 16),
    ([900, 2100, 64], [300, 1, 64], 32, 4, 128, 32),
    ([1, 2, 3, 4, 5, 6, 7, 8], [1] * 8, 8, 1, 64, 16),
]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"shape{i}" for i in range(len(SHAPES))])
def test_triton_matches_reference_on_gpu(shape, dtype, tol):
    seq_lens, query_lens, heads, kv_heads, dim, page = shape
    for seed in range(2):  # fresh inputs each time
        q, k, v, kv_cache, meta = random_batch(seq_lens, query_lens, heads, kv_heads, dim, page, dtype=dtype,
                                               device="cuda", seed=seed, pad_seqs=1)
        ref_cache = kv_cache.clone()
        ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, dim ** -0.5)
        cache = kv_cache.clone()
        store_kv(k, v, cache, meta.slot_mapping)
        assert torch.equal(cache, ref_cache)
        splits = [1, 8]
        for n in splits:
            out = torch.full_like(q, float("nan"))  # poison: every row must be written
            paged_attention(q, cache, meta, dim ** -0.5, num_splits=n, out=out)
            real = meta.slot_mapping >= 0
            assert torch.isfinite(out).all()
            assert _rel(out[real], ref[real]) < tol, (n, _rel(out[real], ref[real]))


def test_backend_splits_only_batches_of_few_programs():
    backend = TritonAttentionBackend()
    q, _, _, cache, meta = random_batch([100], [1], 32, 32, 128, 16, device="cuda")
    assert backend.num_splits(q, cache, meta) > 1
    q, _, _, cache, meta = random_batch([1700], [11], 28, 4, 128, 16, device="cuda")
    assert backend.num_splits(q, cache, meta) > 1  # a prefix hit's last tokens
    q, _, _, cache, meta = random_batch([2000, 50], [1000, 3], 32, 32, 128, 16, device="cuda")
    assert backend.num_splits(q, cache, meta) == 1
