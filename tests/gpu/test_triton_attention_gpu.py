"""The Triton paged-attention kernels, compiled on the GPU, against the torch reference at real shapes:
llava-1.5-7b heads (32 x 128, no GQA) and GQA 4 and 8, page sizes 16 and 32, long contexts, prefill
chunks over a cached prefix mixed with decode rows, split keys; fp32 (IEEE dots) and bf16. Then sliding
windows and per-row key limits (Gemma 3: head_dim 256 and 128, window 1024, 256-token images, 4-8k
contexts), decode rows with a window inside a CUDA graph, and the time a window saves."""

from __future__ import annotations

import pytest
import torch

from common.kernels.attention import paged_attention
from common.kernels.kv_store import store_kv
from decoder_svc.model.attention import TorchAttentionBackend
from decoder_svc.model.kernel_dispatch import TritonAttentionBackend
from tests.engine.test_triton_attention import random_batch

pytestmark = pytest.mark.gpu

SHAPES = [
    # seq_lens, query_lens, heads, kv_heads, dim, page
    ([1500, 3000, 17, 600], [1, 1, 1, 600], 32, 32, 128, 16),
    ([4000] * 3, [1] * 3, 32, 8, 128, 16),
    ([900, 2100, 64], [300, 1, 64], 32, 4, 128, 32),
    ([1, 2, 3, 4, 5, 6, 7, 8], [1] * 8, 8, 1, 64, 16),
    ([300] * 31 + [5], [1] * 32, 28, 4, 128, 16),  # 32 decode rows, Qwen2.5-VL-7B's GQA 7 (the decode path)
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


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[4]], ids=["mixed", "decode32"])
def test_heads_first_and_sequences_first_give_the_same_bits(shape):
    """The programs' order (AttentionTiles.heads_first) changes when each program runs, not what it
    computes: both orders write the same bits, split or not."""
    from common.kernels.attention import AttentionTiles

    seq_lens, query_lens, heads, kv_heads, dim, page = shape
    q, k, v, cache, meta = random_batch(seq_lens, query_lens, heads, kv_heads, dim, page,
                                        dtype=torch.bfloat16, device="cuda", seed=3)
    store_kv(k, v, cache, meta.slot_mapping)
    for n in (1, 4):
        first, by_seq = (paged_attention(q, cache, meta, dim ** -0.5, num_splits=n,
                                         tiles=AttentionTiles(64, heads_first=order))
                         for order in (True, False))
        assert torch.equal(first, by_seq), n


def test_backend_splits_only_batches_of_few_programs():
    backend = TritonAttentionBackend()
    q, _, _, cache, meta = random_batch([100], [1], 32, 32, 128, 16, device="cuda")
    assert backend.num_splits(q, cache, meta) > 1
    q, _, _, cache, meta = random_batch([1700], [11], 28, 4, 128, 16, device="cuda")
    assert backend.num_splits(q, cache, meta) > 1  # a prefix hit's last tokens
    q, _, _, cache, meta = random_batch([2000, 50], [1000, 3], 32, 32, 128, 16, device="cuda")
    assert backend.num_splits(q, cache, meta) == 1


# Sliding windows and key limits (Gemma 3: head_dim 256 with 8 heads over 4 KV heads in the 4B, 16/8 in
# the 12B; head_dim 128 with 32/16 in the 27B; window 1024; 256-token images).
MASKED = [
    # seq_lens, query_lens, heads, kv_heads, dim, page, images {seq: [(start, end)]}
    ([8192, 4100, 6000, 1030], [1, 1, 1, 1], 8, 4, 256, 16, {}),              # decodes (split keys)
    # a chunk over a prefix, images across its start, inside it and at its end
    ([5000, 4000, 777], [1200, 1, 1], 8, 4, 256, 16, {0: [(3700, 3956), (4200, 4456), (4744, 5000)]}),
    ([4096, 2600], [4096, 1], 16, 8, 256, 16, {0: [(100, 356), (1500, 1756), (3000, 3256)]}),  # a prompt
    ([6000, 2500, 64, 7000], [2048, 1, 64, 1], 32, 16, 128, 32,
     {0: [(3900, 4156), (5000, 5256)], 2: [(0, 64)]}),
    ([8000], [300], 32, 16, 128, 16, {0: [(7744, 8000)]}),                    # a prefix hit's last tokens
]


@pytest.mark.parametrize("window", [None, 1024])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", MASKED, ids=[f"masked{i}" for i in range(len(MASKED))])
def test_window_and_key_limits_match_reference_on_gpu(shape, dtype, tol, window):
    from tests.engine.test_triton_attention_masks import image_limits, with_limits

    *shape, images = shape
    seq_lens, query_lens, heads, kv_heads, dim, page = shape
    if window is None and not images:
        pytest.skip("the plain causal case is test_triton_matches_reference_on_gpu's")
    q, k, v, kv_cache, meta = random_batch(seq_lens, query_lens, heads, kv_heads, dim, page, dtype=dtype,
                                           device="cuda", seed=1, pad_seqs=1)
    meta = with_limits(meta, image_limits(seq_lens, query_lens, images, pad_rows=1) if images else None)
    ref_cache = kv_cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, dim ** -0.5, window=window)
    store_kv(k, v, kv_cache, meta.slot_mapping)
    real = meta.slot_mapping >= 0
    for n in (1, 4, 16):
        out = torch.full_like(q, float("nan"))  # poison: every row must be written
        paged_attention(q, kv_cache, meta, dim ** -0.5, num_splits=n, out=out, window=window)
        assert torch.isfinite(out).all(), n
        assert _rel(out[real], ref[real]) < tol, (n, _rel(out[real], ref[real]))
    out = TritonAttentionBackend().forward(q, k, v, kv_cache, meta, dim ** -0.5, window=window)
    assert _rel(out[real], ref[real]) < tol


def test_window_decode_replays_in_a_cuda_graph():
    """A graph captured for decode rows with a window (and split keys) replays with new lengths."""
    from decoder_svc.model.attention import AttentionMetadata

    seq_lens, page, dim = [5000, 1100, 3000, 8000], 16, 256
    q, k, v, cache, meta = random_batch(seq_lens, [1] * 4, 8, 4, dim, page, dtype=torch.bfloat16,
                                        device="cuda", seed=4)
    backend = TritonAttentionBackend()
    assert backend.num_splits(q, cache, meta) > 1
    # Captured while each sequence was 700 tokens shorter (same blocks, other slots and lengths).
    short = [n - 700 for n in seq_lens]
    tables = meta.block_tables.cpu()
    slots = [int(tables[i, (n - 1) // page]) * page + (n - 1) % page for i, n in enumerate(short)]
    g_meta = AttentionMetadata(torch.tensor(slots, device="cuda"), meta.query_start_loc.clone(),
                               torch.tensor(short, dtype=torch.int32, device="cuda"),
                               meta.block_tables.clone(), page, 1)
    gq, gk, gv, g_cache = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v), cache.clone()
    backend.forward(gq, gk, gv, g_cache, g_meta, dim ** -0.5, window=1024)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(gq, gk, gv, g_cache, g_meta, dim ** -0.5, window=1024)
    for dst, src in ((g_meta.slot_mapping, meta.slot_mapping), (g_meta.seq_lens, meta.seq_lens),
                     (gq, q), (gk, k), (gv, v), (g_cache, cache)):
        dst.copy_(src)
    graph.replay()
    ref = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, dim ** -0.5, window=1024)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[4], ([300, 4096, 63, 64], [1] * 4, 32, 32, 128, 16)],
                         ids=["gqa4", "gqa7-32rows", "llava"])
def test_decode_steps_rotate_and_store_inside_attention_on_gpu(shape, dtype, tol):
    """A decode step's attention kernel rotates q and stores this step's rotated keys and values itself
    (common/kernels/attention.DecodeRotary), compiled: the cache gets the bits the separate rotary + store
    launch writes, the output that launch pair's (within the softmax's FMAs: the rotating kernel is compiled
    without contraction) and the torch reference's; and the same inside a CUDA graph (launched early)."""
    from decoder_svc.model.kernel_dispatch import TritonOps
    from decoder_svc.model.ops import TorchOps
    from tests.engine.test_triton_kv_store import _fused, _table

    seq_lens, query_lens, heads, kv_heads, dim, page = shape
    q, k, v, cache, meta = random_batch(seq_lens, query_lens, heads, kv_heads, dim, page, dtype=dtype,
                                        device="cuda", seed=11, pad_seqs=2)
    positions = torch.tensor([n - 1 for n in seq_lens] + [0, 0], device="cuda")
    table = _table(dim, 8192)
    scale = dim ** -0.5

    def run(rotate_in_attention: bool):
        _, qv, kv, vv = _fused(q, k, v)
        c = cache.clone()
        backend = TritonAttentionBackend(rotate_in_attention=rotate_in_attention)
        return backend.rotate_and_forward(qv, kv, vv, TritonOps.rotary, positions, table, c, meta, scale), c

    want, want_cache = run(False)
    got, got_cache = run(True)
    real = len(seq_lens)
    assert torch.equal(got_cache, want_cache)
    assert _rel(got[:real], want[:real]) < tol
    ref_cache = cache.clone()
    ref = TorchAttentionBackend().rotate_and_forward(q.clone(), k.clone(), v, TorchOps.rotary, positions,
                                                     table, ref_cache, meta, scale)
    assert torch.equal(got_cache, ref_cache) and _rel(got[:real], ref[:real]) < tol

    buf, gq, gk, gv = _fused(q, k, v)
    g_cache = cache.clone()
    backend = TritonAttentionBackend(rotate_in_attention=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        TritonOps.rms_norm(buf[:, :dim], torch.ones(dim, dtype=dtype, device="cuda"), 1e-5)
        out = backend.rotate_and_forward(gq, gk, gv, TritonOps.rotary, positions, table, g_cache, meta, scale)
    buf.copy_(_fused(q, k, v)[0])
    g_cache.copy_(cache)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_cache, got_cache) and torch.equal(out[:real], got[:real])
