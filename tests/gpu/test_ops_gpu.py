"""Triton decoder ops against the torch reference on CUDA at Llama-7B sizes (bf16 and fp32)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")

from decoder_svc.model.ops import TorchOps  # noqa: E402

if torch.cuda.is_available():  # tests/gpu/conftest.py skips these without a device
    from decoder_svc.model.kernel_dispatch import TritonOps

HIDDEN, INTER, N_HEADS, HEAD_DIM = 4096, 11008, 32, 128
TOKENS = [1, 7, 64, 1000]
# Relative error norm bounds: bf16 allows a rounding here and there, fp32 only reordering of sums.
REL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
DTYPES = [torch.bfloat16, torch.float32]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _rand(shape, dtype, gen, scale=1.0, offset=0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device="cuda") * scale + offset).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tok", TOKENS)
def test_rms_norm_gpu(dtype, n_tok):
    gen = torch.Generator(device="cuda").manual_seed(n_tok)
    weight = _rand(HIDDEN, dtype, gen, scale=0.2, offset=1.0)
    x = _rand((n_tok, HIDDEN), dtype, gen, scale=3.0)
    res = _rand((n_tok, HIDDEN), dtype, gen, scale=10.0, offset=0.5)
    x0 = x.clone()

    out, new_res = TritonOps.rms_norm(x, weight, 1e-5)
    ref, _ = TorchOps.rms_norm(x, weight, 1e-5)
    assert new_res is x and _rel_err(out, ref) < REL[dtype]

    ref, ref_res = TorchOps.rms_norm(x, weight, 1e-5, residual=res)
    out, new_res = TritonOps.rms_norm(x, weight, 1e-5, residual=res)
    assert new_res is res and torch.equal(res, ref_res)  # in place, bit-exact dtype add
    assert _rel_err(out, ref) < REL[dtype]
    assert torch.equal(x, x0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tok", TOKENS)
def test_silu_and_mul_gpu(dtype, n_tok):
    gen = torch.Generator(device="cuda").manual_seed(100 + n_tok)
    x = _rand((n_tok, 2 * INTER), dtype, gen, scale=4.0)
    out = TritonOps.silu_and_mul(x)
    assert out.shape == (n_tok, INTER) and _rel_err(out, TorchOps.silu_and_mul(x)) < REL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tok", TOKENS)
@pytest.mark.parametrize("width", [2560, 256])  # gemma-3-4b's hidden size, and its head_dim (QK norm)
def test_offset_rms_norm_gpu(dtype, n_tok, width):
    gen = torch.Generator(device="cuda").manual_seed(300 + n_tok + width)
    weight = _rand(width, dtype, gen, scale=0.2, offset=0.1)
    x = _rand((n_tok, width), dtype, gen, scale=3.0)
    res = _rand((n_tok, width), dtype, gen, scale=10.0, offset=0.5)
    out, new_res = TritonOps.offset_rms_norm(x, weight, 1e-6)
    assert new_res is x and _rel_err(out, TorchOps.offset_rms_norm(x, weight, 1e-6)[0]) < REL[dtype]
    ref, ref_res = TorchOps.offset_rms_norm(x, weight, 1e-6, residual=res)
    out, new_res = TritonOps.offset_rms_norm(x, weight, 1e-6, residual=res)
    assert new_res is res and torch.equal(res, ref_res) and _rel_err(out, ref) < REL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tok", TOKENS)
@pytest.mark.parametrize("q_heads, k_heads, head_dim, unit_offset",  # Qwen3-VL-8B, -30B-A3B, Gemma 3 4B
                         [(32, 8, 128, False), (32, 4, 128, False), (8, 4, 256, True)])
def test_qk_norm_gpu(dtype, n_tok, q_heads, k_heads, head_dim, unit_offset):
    """The one-launch QK norm over the heads of a qkv product stays as close to the reference as the row
    kernel over the heads copied into rows does (its sums of squares reduce in another order: not bit for
    bit)."""
    gen = torch.Generator(device="cuda").manual_seed(500 + n_tok + head_dim)
    qkv = _rand((n_tok, (q_heads + 2 * k_heads) * head_dim), dtype, gen, scale=3.0)
    q = qkv[:, :q_heads * head_dim].view(n_tok, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + k_heads) * head_dim].view(n_tok, k_heads, head_dim)
    wq, wk = _rand(head_dim, dtype, gen, scale=0.2, offset=1.0), _rand(head_dim, dtype, gen, scale=0.2)
    q_out, k_out = TritonOps.qk_norm(q, k, wq, wk, 1e-6, unit_offset)
    ref_q, ref_k = TorchOps.qk_norm(q, k, wq, wk, 1e-6, unit_offset)
    row_norm = TritonOps.offset_rms_norm if unit_offset else TritonOps.rms_norm
    for out, ref, x, w in ((q_out, ref_q, q, wq), (k_out, ref_k, k, wk)):
        rows = row_norm(x.reshape(-1, head_dim).contiguous(), w, 1e-6)[0].view(x.shape)
        assert out.shape == x.shape and out.is_contiguous()
        assert _rel_err(out, ref) < REL[dtype] and _rel_err(out, rows) < REL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tok", TOKENS)
def test_gelu_tanh_and_mul_gpu(dtype, n_tok):
    gen = torch.Generator(device="cuda").manual_seed(400 + n_tok)
    x = _rand((n_tok, 2 * 10240), dtype, gen, scale=4.0)  # gemma-3-4b's intermediate size
    out = TritonOps.gelu_tanh_and_mul(x)
    assert out.shape == (n_tok, 10240) and _rel_err(out, TorchOps.gelu_tanh_and_mul(x)) < REL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tok", TOKENS)
@pytest.mark.parametrize("n_kv_heads", [N_HEADS, 8])
def test_rotary_gpu(dtype, n_tok, n_kv_heads):
    gen = torch.Generator(device="cuda").manual_seed(200 + n_tok)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    cache = TorchOps.make_cos_sin_cache(inv_freq, 8192)
    positions = torch.randint(0, 8192, (n_tok,), generator=gen, device="cuda")
    # q and k as strided views into one fused qkv output.
    q_w, k_w = N_HEADS * HEAD_DIM, n_kv_heads * HEAD_DIM
    buf = _rand((n_tok, q_w + 2 * k_w), dtype, gen, scale=2.0)
    q = buf[:, :q_w].view(n_tok, N_HEADS, HEAD_DIM)
    k = buf[:, q_w: q_w + k_w].view(n_tok, n_kv_heads, HEAD_DIM)
    v_before = buf[:, q_w + k_w:].clone()
    ref_q, ref_k = TorchOps.rotary(q, k, positions, cache)

    out_q, out_k = TritonOps.rotary(q, k, positions, cache)
    assert out_q is q and out_k is k
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)  # HF's rounding points, no fma (RotaryLaunch)
    assert torch.equal(buf[:, q_w + k_w:], v_before)


def test_empty_batches_gpu():
    x = torch.empty(0, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    assert TritonOps.rms_norm(x, w, 1e-5, residual=x.clone())[0].shape == (0, HIDDEN)
    assert TritonOps.silu_and_mul(torch.empty(0, 2 * INTER, device="cuda")).shape == (0, INTER)
    q = torch.empty(0, N_HEADS, HEAD_DIM, device="cuda")
    cache = torch.zeros(16, HEAD_DIM, device="cuda")
    assert TritonOps.rotary(q, q[:, :8], torch.empty(0, dtype=torch.long, device="cuda"), cache)[0] is q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tok", TOKENS)
@pytest.mark.parametrize("n_kv_heads,width", [(N_HEADS, HEAD_DIM), (8, HEAD_DIM), (8, 96)])
def test_rotary_store_kv_gpu(dtype, n_tok, n_kv_heads, width):
    """The rotary + KV store kernel writes what TritonOps.rotary then store_kv write, compiled at 7B sizes
    (96 of 128 dims rotated: partial rotary), with a padded row; and the same bits inside a CUDA graph
    (both launched early, pdl.py)."""
    from common.kernels.kv_store import rotary_store_kv, store_kv

    gen = torch.Generator(device="cuda").manual_seed(300 + n_tok + width)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, width, 2, device="cuda").float() / width))
    table = TorchOps.make_cos_sin_cache(inv_freq, 8192)
    positions = torch.randint(0, 8192, (n_tok,), generator=gen, device="cuda")
    q_w, k_w = N_HEADS * HEAD_DIM, n_kv_heads * HEAD_DIM
    qkv = _rand((n_tok, q_w + 2 * k_w), dtype, gen, scale=2.0)
    page, blocks = 16, n_tok // 16 + 4
    cache = _rand((2, blocks, page, n_kv_heads, HEAD_DIM), dtype, gen)
    slots = torch.randperm(blocks * page, generator=gen, device="cuda")[:n_tok]
    slots[-1] = -1  # a CUDA graph's padding row: stores nothing

    def views(buf):
        kv_shape = (n_tok, n_kv_heads, HEAD_DIM)
        return (buf[:, :q_w].view(n_tok, N_HEADS, HEAD_DIM), buf[:, q_w:q_w + k_w].view(kv_shape),
                buf[:, q_w + k_w:].view(kv_shape))

    want_qkv, want_cache = qkv.clone(), cache.clone()
    q, k, v = views(want_qkv)
    TritonOps.rotary(q, k, positions, table)
    store_kv(k, v, want_cache, slots)
    ref_q, ref_k = TorchOps.rotary(*views(qkv.clone())[:2], positions, table)
    # Both kernels round each product before the sum as HF (and torch's separate ops) do, never
    # contracting a product into the sum (RotaryLaunch.options): the same bits as torch, in bf16 and fp32.
    exact = dict(rtol=0, atol=0)
    torch.testing.assert_close(q, ref_q, **exact)
    torch.testing.assert_close(k, ref_k, **exact)

    got_qkv, got_cache = qkv.clone(), cache.clone()
    rotary_store_kv(*views(got_qkv), positions, table, got_cache, slots)
    torch.testing.assert_close(got_qkv[:, :q_w], want_qkv[:, :q_w], **exact)
    torch.testing.assert_close(got_cache, want_cache, **exact)
    assert torch.equal(got_qkv[:, q_w:], qkv[:, q_w:])  # k and v left as they were

    graph_qkv, graph_cache = qkv.clone(), cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        TritonOps.rms_norm(graph_qkv[:, :HIDDEN], torch.ones(HIDDEN, dtype=dtype, device="cuda"), 1e-5)
        rotary_store_kv(*views(graph_qkv), positions, table, graph_cache, slots)
    graph_qkv.copy_(qkv)
    graph_cache.copy_(cache)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_qkv, got_qkv) and torch.equal(graph_cache, got_cache)
