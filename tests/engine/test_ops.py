"""Decoder elementwise ops: the torch reference against HF Llama, and the Triton kernels against the
reference (on CPU through the Triton interpreter, so shapes stay small)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: the interpreter runs the kernels in numpy on CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    rotate_half,
)

from decoder_svc.model.kernel_dispatch import TritonOps  # noqa: E402
from decoder_svc.model.ops import TorchOps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Triton vs reference: fp32 to ~1e-5; low precision to about one rounding of the dtype.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _rand(shape, dtype, gen, scale=3.0, offset=0.5) -> torch.Tensor:
    """Fresh non-trivial draws (not unit scale, not centred) in the target dtype."""
    return (torch.randn(shape, generator=gen, device=DEVICE) * scale + offset).to(dtype)


def _llama_config(head_dim: int, max_pos: int = 512) -> LlamaConfig:
    return LlamaConfig(hidden_size=4 * head_dim, intermediate_size=40, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=max_pos,
                       rope_theta=10000.0)


# ---------------------------------------------------------------- reference vs Hugging Face


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_rms_norm_matches_hf(dtype):
    gen = torch.Generator().manual_seed(1)
    hf = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(48, generator=gen) * 0.5 + 1.0)
    hf = hf.to(dtype)
    x = (torch.randn(5, 48, generator=gen) * 4 + 1).to(dtype)
    res = (torch.randn(5, 48, generator=gen) * 2).to(dtype)
    x0, res0 = x.clone(), res.clone()

    out, new_res = TorchOps.rms_norm(x, hf.weight.detach(), 1e-5)
    assert new_res is x
    torch.testing.assert_close(out, hf(x).detach(), rtol=0, atol=0)

    out, new_res = TorchOps.rms_norm(x, hf.weight.detach(), 1e-5, residual=res)
    expected_res = res + x  # HF: residual + hidden_states
    assert torch.equal(new_res, expected_res)
    torch.testing.assert_close(out, hf(expected_res).detach(), rtol=0, atol=0)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # no in-place writes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_silu_and_mul_matches_hf_mlp(dtype):
    torch.manual_seed(2)
    cfg = _llama_config(16)
    mlp = LlamaMLP(cfg).to(dtype)
    x = (torch.randn(3, cfg.hidden_size) * 2).to(dtype)
    with torch.no_grad():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        ours = TorchOps.silu_and_mul(torch.cat((gate, up), dim=-1))
        # HF's LlamaMLP.forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)).
        torch.testing.assert_close(ours, mlp.act_fn(gate) * up, rtol=0, atol=0)
        # The gemm may pick another kernel for a differently laid-out input, hence not bit-exact here.
        torch.testing.assert_close(mlp.down_proj(ours), mlp(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_rotary_matches_hf(dtype):
    gen = torch.Generator().manual_seed(3)
    head_dim, n_tok = 16, 6
    cfg = _llama_config(head_dim)
    rope = LlamaRotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 7, 100, 300, 511])
    q = (torch.randn(n_tok, 4, head_dim, generator=gen) * 3).to(dtype)
    k = (torch.randn(n_tok, 2, head_dim, generator=gen) * 3).to(dtype)
    q0, k0 = q.clone(), k.clone()

    cos, sin = rope(q, positions[None])  # [1, T, D], already cast to dtype by HF
    cache = TorchOps.make_cos_sin_cache(rope.inv_freq, cfg.max_position_embeddings)
    assert cache.dtype == torch.float32 and cache.shape == (512, head_dim)
    # The cache holds cos|sin of the D/2 frequencies; HF's emb duplicates them.
    half = head_dim // 2
    torch.testing.assert_close(torch.cat((cache[positions, :half],) * 2, -1).to(dtype), cos[0],
                               rtol=0, atol=0)
    torch.testing.assert_close(torch.cat((cache[positions, half:],) * 2, -1).to(dtype), sin[0],
                               rtol=0, atol=0)

    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)  # cos [T, 1, D]
    q_rot, k_rot = TorchOps.rotary(q, k, positions, cache)
    torch.testing.assert_close(q_rot, q_hf, rtol=0, atol=0)
    torch.testing.assert_close(k_rot, k_hf, rtol=0, atol=0)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    # And the convention really is HF's rotate_half.
    c, s = cos[0][:, None], sin[0][:, None]
    torch.testing.assert_close(q_rot, q * c + rotate_half(q) * s, rtol=0, atol=0)


# ---------------------------------------------------------------- Triton vs reference


def _fused_qkv(n_tok, n_q, n_k, head_dim, dtype, gen):
    """q, k as strided views into one [T, (Hq + 2 Hk) * D] buffer, like a fused qkv projection."""
    buf = _rand((n_tok, (n_q + 2 * n_k) * head_dim), dtype, gen)
    q = buf[:, : n_q * head_dim].view(n_tok, n_q, head_dim)
    k = buf[:, n_q * head_dim: (n_q + n_k) * head_dim].view(n_tok, n_k, head_dim)
    return buf, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 48), (5, 64), (3, 130)])
def test_triton_rms_norm(dtype, shape):
    gen = _gen(shape[0] * 1000 + shape[1] + DTYPES.index(dtype))
    weight = _rand(shape[1], dtype, gen, scale=0.5, offset=1.0)
    x = _rand(shape, dtype, gen)
    x0 = x.clone()
    out, new_res = TritonOps.rms_norm(x, weight, 1e-6)
    ref_out, _ = TorchOps.rms_norm(x, weight, 1e-6)
    assert new_res is x and out.dtype == dtype
    torch.testing.assert_close(out, ref_out, **TOL[dtype])

    res = _rand(shape, dtype, gen, scale=2.0, offset=-1.0)
    ref_out, ref_res = TorchOps.rms_norm(x, weight, 1e-6, residual=res)
    out, new_res = TritonOps.rms_norm(x, weight, 1e-6, residual=res)
    assert new_res is res  # written in place into the caller's residual
    assert torch.equal(new_res, ref_res)  # the dtype add is bit-exact
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    assert torch.equal(x, x0)


def test_triton_rms_norm_strided_rows_and_empty():
    gen = _gen(11)
    wide = _rand((4, 80), torch.float32, gen)
    x = wide[:, 8:56]  # row stride 80, 48 columns
    weight = _rand(48, torch.float32, gen, scale=0.5, offset=1.0)
    res_wide = _rand((4, 64), torch.float32, gen)
    res = res_wide[:, :48]
    ref_out, ref_res = TorchOps.rms_norm(x, weight, 1e-5, residual=res.clone())
    out, new_res = TritonOps.rms_norm(x, weight, 1e-5, residual=res)
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32])
    assert torch.equal(res, ref_res) and torch.equal(res_wide[:, 48:], res_wide.clone()[:, 48:])

    empty = torch.empty(0, 48, device=DEVICE)
    out, new_res = TritonOps.rms_norm(empty, weight, 1e-5, residual=empty.clone())
    assert out.shape == (0, 48) and new_res.shape == (0, 48)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("tokens, q_heads, k_heads, head_dim, gated",
                         [(1, 4, 2, 16, False), (5, 6, 2, 24, False), (3, 3, 1, 40, True),
                          (0, 4, 2, 16, False)])
def test_triton_qk_norm_reads_the_heads_in_place_in_one_launch(dtype, unit_offset, tokens, q_heads, k_heads,
                                                               head_dim, gated):
    """Each head of q and k, strided views of one qkv row (a gated query interleaves its gate per head),
    normed with its own weight: as close to the reference as the row kernel over the heads copied into rows
    (its sums reduce in another order on a GPU); qkv untouched; new contiguous tensors."""
    gen = _gen(tokens * 97 + q_heads * head_dim + DTYPES.index(dtype) + 7 * unit_offset)
    q_width = q_heads * head_dim * (2 if gated else 1)
    qkv = _rand((tokens, q_width + 2 * k_heads * head_dim), dtype, gen)
    qkv0 = qkv.clone()
    if gated:
        q = qkv[:, :q_width].view(tokens, q_heads, 2 * head_dim)[..., :head_dim]
    else:
        q = qkv[:, :q_width].view(tokens, q_heads, head_dim)
    k = qkv[:, q_width:q_width + k_heads * head_dim].view(tokens, k_heads, head_dim)
    wq, wk = (_rand(head_dim, dtype, gen, scale=0.3, offset=0.8) for _ in range(2))
    q_out, k_out = TritonOps.qk_norm(q, k, wq, wk, 1e-6, unit_offset)
    ref_q, ref_k = TorchOps.qk_norm(q, k, wq, wk, 1e-6, unit_offset)
    row_norm = TritonOps.offset_rms_norm if unit_offset else TritonOps.rms_norm
    for out, ref, x, w in ((q_out, ref_q, q, wq), (k_out, ref_k, k, wk)):
        assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
        rows = row_norm(x.reshape(-1, head_dim).contiguous(), w, 1e-6)[0].view(x.shape)
        torch.testing.assert_close(out, rows, **TOL[dtype])
        torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(qkv, qkv0)


def test_triton_qk_norm_refuses_what_does_not_pair():
    q = torch.zeros(2, 4, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous last dim"):
        TritonOps.qk_norm(q.transpose(1, 2), q, w, w, 1e-6)
    with pytest.raises(ValueError, match="does not pair"):
        TritonOps.qk_norm(q, torch.zeros(3, 2, 16, device=DEVICE), w, w, 1e-6)
    with pytest.raises(ValueError, match="k weight must be"):
        TritonOps.qk_norm(q, q, w, torch.ones(8, device=DEVICE), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 48), (7, 300)])
def test_triton_silu_and_mul(dtype, shape):
    n_tok, inter = shape
    gen = _gen(inter + n_tok)
    x = _rand((n_tok, 2 * inter), dtype, gen)
    x0 = x.clone()
    out = TritonOps.silu_and_mul(x)
    assert out.shape == (n_tok, inter) and out.dtype == dtype
    torch.testing.assert_close(out, TorchOps.silu_and_mul(x), **TOL[dtype])
    assert torch.equal(x, x0)
    assert TritonOps.silu_and_mul(torch.empty(0, 2 * inter, dtype=dtype, device=DEVICE)).shape == (0, inter)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 48), (5, 64), (3, 130)])
def test_triton_offset_rms_norm_is_gemmas(dtype, shape):
    """Gemma's (1 + w) norm in one kernel against the reference and HF's Gemma3RMSNorm, with and without
    a residual (written in place), x untouched."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = _gen(shape[0] * 100 + shape[1] + DTYPES.index(dtype))
    weight = _rand(shape[1], dtype, gen, scale=0.5, offset=0.2)
    x = _rand(shape, dtype, gen)
    x0 = x.clone()
    hf = Gemma3RMSNorm(shape[1], eps=1e-6).to(DEVICE)
    with torch.no_grad():
        hf.weight.copy_(weight.float())
    out, new_res = TritonOps.offset_rms_norm(x, weight, 1e-6)
    assert new_res is x and out.dtype == dtype
    torch.testing.assert_close(out, TorchOps.offset_rms_norm(x, weight, 1e-6)[0], **TOL[dtype])
    torch.testing.assert_close(out, hf(x), **TOL[dtype])

    res = _rand(shape, dtype, gen, scale=2.0, offset=-1.0)
    res0 = res.clone()
    ref_out, ref_res = TorchOps.offset_rms_norm(x, weight, 1e-6, residual=res)
    out, new_res = TritonOps.offset_rms_norm(x, weight, 1e-6, residual=res)
    assert new_res is res and torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    assert torch.equal(x, x0)
    # Not Llama's norm: a kernel that ignored the offset would give this.
    assert not torch.allclose(out, TorchOps.rms_norm(x, weight, 1e-6, residual=res0)[0], **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 48), (7, 300)])
def test_triton_gelu_tanh_and_mul(dtype, shape):
    """GeGLU (HF's gelu_pytorch_tanh(gate) * up) against the reference, over values from -9 to 9."""
    n_tok, inter = shape
    gen = _gen(inter + 7 * n_tok)
    x = _rand((n_tok, 2 * inter), dtype, gen)
    x0 = x.clone()
    out = TritonOps.gelu_tanh_and_mul(x)
    assert out.shape == (n_tok, inter) and out.dtype == dtype
    torch.testing.assert_close(out, TorchOps.gelu_tanh_and_mul(x), **TOL[dtype])
    assert not torch.allclose(out, TorchOps.silu_and_mul(x), **TOL[dtype])
    assert torch.equal(x, x0)
    empty = torch.empty(0, 2 * inter, dtype=dtype, device=DEVICE)
    assert TritonOps.gelu_tanh_and_mul(empty).shape == (0, inter)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_tok,n_q,n_k,head_dim", [(1, 4, 2, 16), (5, 4, 2, 16), (3, 3, 1, 48),
                                                    (2, 2, 2, 128)])
def test_triton_rotary_in_place_on_fused_qkv(dtype, n_tok, n_q, n_k, head_dim):
    gen = _gen(n_tok * 1000 + head_dim)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    cache = TorchOps.make_cos_sin_cache(inv_freq, 2048)
    positions = torch.randint(0, 2048, (n_tok,), generator=gen, device=DEVICE)
    buf, q, k = _fused_qkv(n_tok, n_q, n_k, head_dim, dtype, gen)
    before = buf.clone()
    ref_q, ref_k = TorchOps.rotary(q.clone(), k.clone(), positions, cache)

    out_q, out_k = TritonOps.rotary(q, k, positions, cache)
    assert out_q is q and out_k is k  # rotated in place
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    v_start = (n_q + n_k) * head_dim
    assert torch.equal(buf[:, v_start:], before[:, v_start:])  # v untouched

    if dtype != torch.float32 and DEVICE == "cpu":
        # Triton rounds where HF does (each product, then the sum): bit-exact in the interpreter (a GPU
        # may contract a product and the sum into one FMA, hence only the tolerance above there).
        torch.testing.assert_close(q, ref_q, rtol=0, atol=0)
        torch.testing.assert_close(k, ref_k, rtol=0, atol=0)


def test_triton_rotary_non_unit_dim_stride_and_empty():
    gen = _gen(21)
    head_dim, n_tok = 16, 3
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    cache = TorchOps.make_cos_sin_cache(inv_freq, 64)
    positions = torch.tensor([63, 0, 5], device=DEVICE, dtype=torch.int64)
    q = _rand((n_tok, head_dim, 2), torch.float32, gen).transpose(1, 2)  # stride(-1) == 2
    k = _rand((n_tok, 1, head_dim), torch.float32, gen)
    ref_q, ref_k = TorchOps.rotary(q, k, positions, cache)
    TritonOps.rotary(q, k, positions, cache)
    torch.testing.assert_close(q, ref_q, **TOL[torch.float32])
    torch.testing.assert_close(k, ref_k, **TOL[torch.float32])

    eq, ek = q[:0], k[:0]
    assert TritonOps.rotary(eq, ek, positions[:0], cache) == (eq, ek)


def test_triton_make_cos_sin_cache_is_reference():
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.equal(TritonOps.make_cos_sin_cache(inv_freq, 32), TorchOps.make_cos_sin_cache(inv_freq, 32))
