"""Triton kernels of the decoder's elementwise ops (RMS norm, gated activations, rotary) and their
launches, for GPU decode and prefill. `TritonOps` (decoder_svc/model/kernel_dispatch.py) exposes them with
the signatures of the torch reference `TorchOps`. Differences in side effects:

- `rms_norm` with a residual writes x + residual IN PLACE into `residual` and returns it as the new
  residual (the caller owns it); `x` is never written. Without a residual the new residual is `x`.
  With `unit_offset` (Gemma's (1 + w) norm) the residual contract is the same.
- `gated_act` (SiLU or tanh-GELU gate times up) returns a new [T, I] tensor.
- `rotary` rotates q and k IN PLACE (they may be strided views of one fused qkv buffer) and returns them.

Numerics follow HF's rounding points: fp32 math, rounding to the tensor dtype exactly where HF's
dtype ops round. RMS norm and SwiGLU then differ from the reference only by the order of the fp32
sum and by exp/rsqrt ulps. Rotary rounds after each product and after the sum, as HF does; only an FMA
contraction on the GPU can move a value by one rounding.

Only imported on GPU paths or under TRITON_INTERPRET=1 (tests), so triton is imported at the top.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.kernels.pdl import release_dependents, small_kernel_launch_options, wait_for_inputs

# The Triton interpreter (3.6) truncates fp32 -> bf16 casts, where the GPU's cvt.rn rounds to nearest
# even like torch; under it, _round does the RNE in integer ops so CPU tests see GPU/torch rounding.
_EMULATE_BF16_RNE = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _round(x, dtype: tl.constexpr):
    # fp32 x rounded to dtype, round-to-nearest-even. On GPU this is just the native conversion.
    if _EMULATE_BF16_RNE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = tl.where(x == x, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), x.to(dtype))  # keep NaN
    else:
        out = x.to(dtype)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, x_stride, res_stride, out_stride, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row: the whole row fits in registers (BLOCK >= n_cols), so one pass.
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # The weight is a parameter, never written: read before the wait (pdl.py), so its load overlaps the
    # kernel before instead of following the row's reduction.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    wait_for_inputs()  # launched early (pdl.py): nothing but the weight is read before
    release_dependents()  # the next kernel may launch now and wait behind this one
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2**31 at long prefills
    dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # fp32 add then one rounding: bit-identical to torch's dtype add.
        h = _round(h.to(tl.float32) + r.to(tl.float32), dtype)
        tl.store(res_ptr + row * res_stride + cols, h, mask=mask)
    out = _normed(h, w, n_cols, eps, dtype, UNIT_OFFSET)
    tl.store(out_ptr + row * out_stride + cols, _round(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _normed(h, w, n_cols, eps, dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """fp32 weight * rmsnorm(h) over the last axis of h (rows of `dtype` values, masked columns 0), with
    HF's rounding points; the caller rounds once to the output dtype."""
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, axis=len(h.shape) - 1, keep_dims=True) / n_cols
    if UNIT_OFFSET:
        # Gemma: (1 + weight) in fp32, the product in fp32, one rounding at the end (HF Gemma3RMSNorm).
        out = hf * tl.math.rsqrt(var + eps) * (1.0 + w.to(tl.float32))
    else:
        # libdevice rsqrtf, as torch.rsqrt uses on CUDA; HF casts back to the dtype before the weight.
        normed = _round(hf * tl.math.rsqrt(var + eps), dtype)
        # Product of two dtype values is exact in fp32, so this single rounding equals torch's dtype mul.
        out = normed.to(tl.float32) * w.to(tl.float32)
    return out


@triton.jit
def _qk_norm_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, qo_ptr, ko_ptr, q_s_tok, q_s_head, k_s_tok, k_s_head,
                    n_q_heads, n_k_heads, head_dim, eps, UNIT_OFFSET: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Programs (tokens, head blocks): blocks below cdiv(n_q_heads, BLOCK_H) norm BLOCK_H of the token's
    query heads, the rest its key heads; each head's row over head_dim, the outputs contiguous."""
    tok = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    if block < q_blocks:
        src_ptr, w_ptr, o_ptr, s_tok, s_head, n_heads = q_ptr, wq_ptr, qo_ptr, q_s_tok, q_s_head, n_q_heads
        first = block * BLOCK_H
    else:
        src_ptr, w_ptr, o_ptr, s_tok, s_head, n_heads = k_ptr, wk_ptr, ko_ptr, k_s_tok, k_s_head, n_k_heads
        first = (block - q_blocks) * BLOCK_H
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0)
    wait_for_inputs()  # launched early (pdl.py): nothing but the weights is read before
    release_dependents()
    heads = first + tl.arange(0, BLOCK_H)
    ok = (heads < n_heads)[:, None] & d_ok[None, :]
    h = tl.load(src_ptr + tok * s_tok + heads[:, None] * s_head + d[None, :], mask=ok, other=0.0)
    out = _normed(h, w[None, :], head_dim, eps, src_ptr.dtype.element_ty, UNIT_OFFSET)
    tl.store(o_ptr + (tok * n_heads + heads[:, None]) * head_dim + d[None, :],
             _round(out, o_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_act_kernel(x_ptr, out_ptr, x_stride, out_stride, n_cols, GELU: tl.constexpr, BLOCK: tl.constexpr):
    # act(gate) * up over x = cat(gate, up): SiLU (Llama's SwiGLU) or, with GELU, HF's gelu_pytorch_tanh
    # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (Gemma's GeGLU), tanh(y) = 2 / (1 + exp(-2y)) - 1
    # (exact limits at +-inf; its cancellation near 0 is absorbed by the 1 + .). HF rounds the activation
    # to the dtype before the product. Grid (rows, column blocks): small blocks fill the GPU at T=1.
    wait_for_inputs()
    release_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = _round(act, dtype)
    tl.store(out_ptr + row * out_stride + cols, _round(act.to(tl.float32) * up, dtype), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, n_rows, x_stride, gate_stride, out_stride, n_cols,
                           eps, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # A Gated DeltaNet layer's output norm over rows of one head each (HF's Qwen3NextRMSNormGated):
    # rmsnorm in fp32, rounded, times the weight (rounded: a dtype product), times SiLU(gate) in fp32.
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    wait_for_inputs()
    release_dependents()
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=1) / n_cols
    normed = _round(x * tl.math.rsqrt(var + eps)[:, None], dtype)
    h = _round(normed.to(tl.float32) * w[None, :], dtype)
    gate = tl.load(gate_ptr + rows[:, None] * gate_stride + cols[None, :], mask=mask, other=0.0)
    gate = gate.to(tl.float32)
    out = h.to(tl.float32) * (gate / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], _round(out, dtype), mask=mask)


@triton.jit
def _delta_gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, beta_ptr, g_ptr, n_rows, a_stride, b_stride,
                        n_heads, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # A Gated DeltaNet layer's gates per token and value head: beta = sigmoid(b) (rounded to b's dtype, as
    # torch's sigmoid in that dtype), g = -exp(A_log) * softplus(a + dt_bias) in fp32 (softplus's
    # threshold 20 as torch's).
    wait_for_inputs()
    release_dependents()
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_heads
    decay = -tl.exp(tl.load(a_log_ptr + cols, mask=col_mask, other=0.0).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    b = tl.load(b_ptr + rows[:, None] * b_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    beta = _round(1.0 / (1.0 + tl.exp(-b)), beta_ptr.dtype.element_ty)
    tl.store(beta_ptr + rows[:, None] * n_heads + cols[None, :], beta, mask=mask)
    a = tl.load(a_ptr + rows[:, None] * a_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = a + dt_bias[None, :]
    # log1p(exp(a)) as max(a, 0) + log1p(exp(-|a|)), log1p(y) = log(u) * y / (u - 1) with u = 1 + y
    # (exact where u rounds to 1): accurate where exp(a) is tiny, as torch's log1p is
    y = tl.exp(-tl.abs(a))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    softplus = tl.where(a > 20.0, a, tl.maximum(a, 0.0) + log1p)
    tl.store(g_ptr + rows[:, None] * n_heads + cols[None, :], decay[None, :] * softplus, mask=mask)


@triton.jit
def rotate_pair(x1, x2, cos, sin, dtype: tl.constexpr):
    """Rotate-half RoPE of the two halves x1, x2 [heads, half] with cos, sin [half] (fp32, already rounded
    to the dtype): out1 = x1*c - x2*s, out2 = x2*c + x1*s, each product rounded to `dtype` before the sum,
    as HF's `q * cos + rotate_half(q) * sin` does in bf16/fp16."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    x1c = _round(x1 * c, dtype).to(tl.float32)
    x2s = _round(x2 * s, dtype).to(tl.float32)
    x2c = _round(x2 * c, dtype).to(tl.float32)
    x1s = _round(x1 * s, dtype).to(tl.float32)
    return _round(x1c - x2s, dtype), _round(x2c + x1s, dtype)


@triton.jit
def _rotate_heads(base, s_head, s_dim, n_heads, cos, sin, half, d, d_mask,
                  BLOCK_HEADS: tl.constexpr):
    # All heads of one token as a [BLOCK_HEADS, BLOCK_HALF] tile, rotated in place.
    heads = tl.arange(0, BLOCK_HEADS)
    mask = (heads[:, None] < n_heads) & d_mask[None, :]
    p1 = base + heads[:, None] * s_head + d[None, :] * s_dim
    p2 = p1 + half * s_dim
    x1 = tl.load(p1, mask=mask, other=0.0)
    out1, out2 = rotate_pair(x1, tl.load(p2, mask=mask, other=0.0), cos, sin, x1.dtype)
    tl.store(p1, out1, mask=mask)
    tl.store(p2, out2, mask=mask)


@triton.jit
def cos_sin_halves(cache_ptr, pos, cache_stride, half, d, d_mask, dtype: tl.constexpr):
    """A position's cos and sin halves from the fp32 table, rounded to `dtype` as HF casts them before use,
    returned in fp32."""
    cs = cache_ptr + pos * cache_stride
    cos = _round(tl.load(cs + d, mask=d_mask, other=0.0).to(tl.float32), dtype).to(tl.float32)
    sin = _round(tl.load(cs + half + d, mask=d_mask, other=0.0).to(tl.float32), dtype).to(tl.float32)
    return cos, sin


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr,
                   q_s_tok, q_s_head, q_s_dim, k_s_tok, k_s_head, k_s_dim, cache_stride,
                   n_q_heads, n_k_heads, half,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # One program per token: cos/sin are loaded once and reused for every q and k head.
    wait_for_inputs()
    release_dependents()
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < half
    cos, sin = cos_sin_halves(cache_ptr, pos, cache_stride, half, d, d_mask, q_ptr.dtype.element_ty)
    _rotate_heads(q_ptr + tok * q_s_tok, q_s_head, q_s_dim, n_q_heads, cos, sin, half, d, d_mask,
                  BLOCK_QH)
    _rotate_heads(k_ptr + tok * k_s_tok, k_s_head, k_s_dim, n_k_heads, cos, sin, half, d, d_mask,
                  BLOCK_KH)


def _row_major(x: torch.Tensor, name: str) -> None:
    # Kernels index rows by stride(0) and columns as contiguous.
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"{name} must be 2-D with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")


@dataclass(frozen=True)
class RotaryLaunch:
    """A rotary launch's checked inputs and tile sizes (`rotary`, and the rotary + KV store kernel
    of kv_store.py). The kernels rotate dims [0, half) with [half, 2 * half) of each head; partial
    rotary (Phi-4-mini) leaves the dims past the table's width as they are, as HF passes them through."""

    half: int
    cache: torch.Tensor  # the cos|sin table, last dim contiguous
    positions: torch.Tensor  # [T], contiguous
    block_qh: int
    block_kh: int
    block_half: int
    num_warps: int

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> RotaryLaunch:
        """Checks q [T, Hq, D], k [T, Hk, D], positions [T] and the table (raises ValueError)."""
        if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise ValueError(f"q [T, Hq, D] and k [T, Hk, D] expected, got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}")
        if q.dtype != k.dtype:
            raise ValueError("q and k must share a dtype")
        n_tok, n_q_heads, head_dim = q.shape
        width = cos_sin_cache.shape[-1]  # the rotated dims: head_dim, or fewer for partial rotary
        if width % 2 or width > head_dim:
            raise ValueError(f"cos_sin_cache last dim must be even and at most head_dim {head_dim}, "
                             f"got {width}")
        if positions.shape != (n_tok,):
            raise ValueError(f"positions must be [{n_tok}], got {tuple(positions.shape)}")
        half = width // 2
        block_qh = triton.next_power_of_2(n_q_heads)
        block_kh = triton.next_power_of_2(max(k.shape[1], 1))
        block_half = triton.next_power_of_2(half)
        tile = max(block_qh, block_kh) * block_half
        return cls(half, cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous(),
                   positions.contiguous(), block_qh, block_kh, block_half, min(max(tile // 256, 1), 8))

    def options(self) -> dict:
        """The launch's compile options: its warps, and no FMA contraction. Left to itself the compiler
        turns a rounded product and the sum after it into one fma.rn.bf16, which skips HF's rounding of
        that product (an ulp off in some 15% of a bf16 head's dims on an H200)."""
        return dict(num_warps=self.num_warps, enable_fp_fusion=False)

def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE applied IN PLACE to q [T, Hq, D] and k [T, Hk, D]; returns (q, k). Partial
    rotary: a cos_sin_cache R < D wide rotates the first R dims of each head only.

    q and k may be arbitrary strided views (e.g. of one fused qkv buffer) but must not overlap.
    Positions are not bounds-checked against the cache (a check would force a host sync).
    """
    rot = RotaryLaunch.of(q, k, positions, cos_sin_cache)
    if q.shape[0] == 0:
        return q, k
    _rotary_kernel[(q.shape[0],)](q, k, rot.positions, rot.cache, *q.stride(), *k.stride(),
                                  rot.cache.stride(0), q.shape[1], k.shape[1], rot.half,
                                  BLOCK_QH=rot.block_qh, BLOCK_KH=rot.block_kh, BLOCK_HALF=rot.block_half,
                                  **rot.options(), **small_kernel_launch_options())
    return q, k


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(h), h) with h = x, or h = x + residual written IN PLACE into residual; with
    `unit_offset`, Gemma's (1 + weight) scaling in fp32 with one rounding. weight must have x's dtype
    [H]; x is never modified; the returned residual is `x` or the `residual` tensor itself. One program
    per row (ValueError on a bad layout)."""
    _row_major(x, "x")
    if weight.dtype != x.dtype or weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if residual is not None:
        _row_major(residual, "residual")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must match x in shape and dtype")
    n_rows, n_cols = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_residual = x if residual is None else residual
    if n_rows == 0 or n_cols == 0:
        return out, new_residual
    weight = weight.contiguous()
    block = triton.next_power_of_2(n_cols)
    # Enough warps that each thread holds <= ~16 fp32 values of the row.
    num_warps = min(max(block // 512, 1), 16)
    res = residual if residual is not None else x  # dummy pointer when HAS_RESIDUAL is False
    _rms_norm_kernel[(n_rows,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n_cols, eps,
                                HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=block,
                                num_warps=num_warps, **small_kernel_launch_options())
    return out, new_residual


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm over each head of q [T, Hq, D] and k [T, Hk, D] (strided views, e.g. of one qkv buffer;
    the last dim contiguous) with their own [D] weights, in one launch; new contiguous tensors, each head
    rounded as rms_norm rounds a row."""
    if q.dim() != 3 or k.dim() != 3 or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"q and k must be [T, heads, D] with a contiguous last dim, got {tuple(q.shape)} "
                         f"{q.stride()} and {tuple(k.shape)} {k.stride()}")
    head_dim = q.shape[2]
    for name, x, w in (("q", q, q_weight), ("k", k, k_weight)):
        if x.shape[2] != head_dim or x.shape[0] != q.shape[0] or x.dtype != q.dtype:
            raise ValueError(f"{name}: {tuple(x.shape)} {x.dtype} does not pair with q {tuple(q.shape)}")
        if w.shape != (head_dim,) or w.dtype != q.dtype:
            raise ValueError(f"{name} weight must be [{head_dim}] {q.dtype}, got {tuple(w.shape)} {w.dtype}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    tokens, n_q, n_k = q.shape[0], q.shape[1], k.shape[1]
    if tokens == 0:
        return q_out, k_out
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(max(n_q, n_k)), 4096 // block_d))  # <= 4096 values a program
    grid = (tokens, triton.cdiv(n_q, block_h) + triton.cdiv(n_k, block_h))
    _qk_norm_kernel[grid](q, k, q_weight.contiguous(), k_weight.contiguous(), q_out, k_out, q.stride(0),
                          q.stride(1), k.stride(0), k.stride(1), n_q, n_k, head_dim, eps,
                          UNIT_OFFSET=unit_offset, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
                          **small_kernel_launch_options())
    return q_out, k_out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [R, D] (one head per row) -> a new [R, D] in x's dtype: rmsnorm(x) * weight * silu(gate), as
    the Gated DeltaNet layer's GatedRMSNorm computes it (weight [D], any float dtype, rounded to x's)."""
    _row_major(x, "x")
    _row_major(gate, "gate")
    if gate.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"gate must be {tuple(x.shape)} and weight [{x.shape[1]}], got {tuple(gate.shape)} "
                         f"and {tuple(weight.shape)}")
    n_rows, n_cols = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if n_rows == 0 or n_cols == 0:
        return out
    weight = weight.to(x.dtype).contiguous()
    block = triton.next_power_of_2(n_cols)
    block_rows = max(1, min(64, 4096 // block))  # about 4K values per program
    _gated_rms_norm_kernel[(triton.cdiv(n_rows, block_rows),)](
        x, gate, weight, out, n_rows, x.stride(0), gate.stride(0), out.stride(0), n_cols, eps,
        BLOCK_ROWS=block_rows, BLOCK=block, num_warps=4, **small_kernel_launch_options())
    return out


def delta_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gated DeltaNet layer's gates of projected rows a, b [N, H]: (beta = sigmoid(b) [N, H] in b's dtype,
    g = -exp(A_log) * softplus(a + dt_bias) [N, H] fp32), GatedDeltaNet._gates's contract, one launch."""
    _row_major(a, "a")
    _row_major(b, "b")
    if b.shape != a.shape or a_log.shape != (a.shape[1],) or dt_bias.shape != (a.shape[1],):
        raise ValueError(f"a, b [N, H] and A_log, dt_bias [H] expected, got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}, {tuple(a_log.shape)}, {tuple(dt_bias.shape)}")
    n_rows, n_heads = a.shape
    beta = torch.empty((n_rows, n_heads), dtype=b.dtype, device=b.device)
    g = torch.empty((n_rows, n_heads), dtype=torch.float32, device=a.device)
    if n_rows == 0 or n_heads == 0:
        return beta, g
    block = triton.next_power_of_2(n_heads)
    block_rows = max(1, min(64, 2048 // block))
    _delta_gates_kernel[(triton.cdiv(n_rows, block_rows),)](
        a, b, a_log.contiguous(), dt_bias.contiguous(), beta, g, n_rows, a.stride(0), b.stride(0), n_heads,
        BLOCK_ROWS=block_rows, BLOCK=block, num_warps=4, **small_kernel_launch_options())
    return beta, g


def gated_act(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    """x [T, 2*I] = cat(gate, up) -> a new [T, I]: silu(gate) * up, or with `gelu` gelu_tanh(gate) * up;
    x is not modified."""
    _row_major(x, "x")
    n_rows, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"last dim must be even (gate, up), got {two_i}")
    n_cols = two_i // 2
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0 or n_cols == 0:
        return out
    # Small tiles at small T so the grid still covers the SMs; big tiles amortise at prefill.
    block = 256 if n_rows < 64 else 1024
    block = min(block, triton.next_power_of_2(n_cols))
    grid = (n_rows, triton.cdiv(n_cols, block))
    _gated_act_kernel[grid](x, out, x.stride(0), out.stride(0), n_cols, GELU=gelu, BLOCK=block,
                            num_warps=4 if block >= 512 else 2, **small_kernel_launch_options())
    return out
