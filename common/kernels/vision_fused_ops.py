"""Triton kernels for the vision towers' elementwise steps on a GPU: one pass each where eager PyTorch
makes five to eight over fp32 temporaries (a 1024x1024 Qwen image is 4096-4900 patch rows x 1152-1280
wide, so every extra pass costs tens of microseconds per block and milliseconds per image).

- `rotary_qkv`: q and k rotated by the 2D rotary in fp32 and rounded back, v copied, from the qkv
  product [N, 3, heads, head_dim] into three contiguous [N, heads, head_dim] tensors (what varlen
  attention reads).
- `add_rms_norm`: (x + delta, RMSNorm of it) in one pass; delta None: the norm alone.
- `add_layer_norm`: (x + delta, LayerNorm of it) in one pass (Qwen3-VL's blocks).
- `silu_mul`: silu(gate) * up over the halves of the fused gate/up product.

Each follows Hugging Face's order of operations and roundings (fp32 inside, the same casts), so bf16
results agree with the eager steps to within a rounding; the eager steps stay the reference (CPU and
tests). Kernels are compiled on first use; `common.families.qwen2_5_vl.tower.VisionOps.fused()` wires them in.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - torch wheels ship triton on Linux; elsewhere the eager ops run
    triton = None


def available() -> bool:
    """True when Triton is importable (the kernels run on CUDA tensors, or anywhere under
    TRITON_INTERPRET=1, which is how the CPU tests check them)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _rotary_qkv_kernel(qkv, cos, sin, out, n, cos_stride,
                           HEADS: tl.constexpr, DIM: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        row = tl.program_id(0)
        h = tl.arange(0, BLOCK_H)[:, None]
        j = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < HEADS) & (j < HALF)
        c = tl.load(cos + row * cos_stride + j, mask=j < HALF, other=0.0).to(tl.float32)
        s = tl.load(sin + row * cos_stride + j, mask=j < HALF, other=0.0).to(tl.float32)
        src = qkv + row * 3 * HEADS * DIM + h * DIM + j
        dst = out + row * HEADS * DIM + h * DIM + j
        part = n * HEADS * DIM
        for p in tl.static_range(2):  # q, then k: x*cos + rotate_half(x)*sin
            x1 = tl.load(src + p * HEADS * DIM, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + p * HEADS * DIM + HALF, mask=mask, other=0.0).to(tl.float32)
            tl.store(dst + p * part, (x1 * c + (-x2) * s).to(out.dtype.element_ty), mask=mask)
            tl.store(dst + p * part + HALF, (x2 * c + x1 * s).to(out.dtype.element_ty), mask=mask)
        for half in tl.static_range(2):  # v, as is
            v = tl.load(src + 2 * HEADS * DIM + half * HALF, mask=mask)
            tl.store(dst + 2 * part + half * HALF, v, mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(x, delta, weight, sum_out, norm_out, width, eps,
                             HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        h = tl.load(x + row * width + cols, mask=mask, other=0.0)
        if HAS_DELTA:  # the residual add in the activations' dtype, as HF's `x = x + attn(...)`
            h = h + tl.load(delta + row * width + cols, mask=mask, other=0.0)
            tl.store(sum_out + row * width + cols, h, mask=mask)
        hf = h.to(tl.float32)
        var = tl.sum(hf * hf, axis=0) / width
        normed = (hf * tl.rsqrt(var + eps)).to(x.dtype.element_ty)  # HF: rsqrt in fp32, cast back
        w = tl.load(weight + cols, mask=mask, other=0.0)
        tl.store(norm_out + row * width + cols, (w.to(tl.float32) * normed.to(tl.float32))
                 .to(norm_out.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_layer_norm_kernel(x, delta, weight, bias, sum_out, norm_out, width, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        h = tl.load(x + row * width + cols, mask=mask, other=0.0)
        h = h + tl.load(delta + row * width + cols, mask=mask, other=0.0)  # in the activations' dtype
        tl.store(sum_out + row * width + cols, h, mask=mask)
        hf = h.to(tl.float32)
        mean = tl.sum(hf, axis=0) / width
        centred = tl.where(mask, hf - mean, 0.0)
        var = tl.sum(centred * centred, axis=0) / width
        w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(bias + cols, mask=mask, other=0.0).to(tl.float32)
        out = centred * tl.rsqrt(var + eps) * w + b  # F.layer_norm: fp32 inside, one rounding at the end
        tl.store(norm_out + row * width + cols, out.to(norm_out.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gate_up, out, width, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        start = tl.program_id(1) * BLOCK
        cols = start + tl.arange(0, BLOCK)
        mask = cols < width
        g = tl.load(gate_up + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate_up + row * 2 * width + width + cols, mask=mask, other=0.0)
        act = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # F.silu in fp32, rounded to the activations' dtype
        tl.store(out + row * width + cols, (act.to(tl.float32) * u.to(tl.float32)).to(out.dtype.element_ty),
                 mask=mask)


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) [N, heads, head_dim] each, contiguous, from qkv [N, 3, heads, head_dim]: q and k rotated
    by cos/sin [N, head_dim] (HF's layout: the same frequencies in both halves; only the first half is
    read), in fp32 and rounded back."""
    n, three, heads, dim = qkv.shape
    if three != 3 or dim % 2 or not qkv.is_contiguous() \
            or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rotary_qkv takes a contiguous [N, 3, heads, head_dim] and cos/sin [N, head_dim]")
    out = torch.empty((3, n, heads, dim), dtype=qkv.dtype, device=qkv.device)
    if n:
        half = dim // 2
        _rotary_qkv_kernel[(n,)](qkv, cos, sin, out, n, cos.stride(0), HEADS=heads, DIM=dim, HALF=half,
                                 BLOCK_H=triton.next_power_of_2(heads),
                                 BLOCK_HALF=triton.next_power_of_2(half))
    return out[0], out[1], out[2]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight) over the last dim of contiguous [N, width] tensors (with
    delta None: (x, RMSNorm(x) * weight)); the norm as HF's Qwen2_5_VLRMSNorm computes it."""
    if x.dim() != 2 or not x.is_contiguous() or (delta is not None and delta.shape != x.shape):
        raise ValueError("add_rms_norm takes contiguous [N, width] tensors of one shape")
    if delta is not None:
        delta = delta.contiguous()
    n, width = x.shape
    summed = torch.empty_like(x) if delta is not None else x
    normed = torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    if n:
        _add_rms_norm_kernel[(n,)](x, delta if delta is not None else x, weight, summed, normed, width, eps,
                                   HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(width))
    return summed, normed


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, LayerNorm(x + delta) * weight + bias) over the last dim of contiguous [N, width]
    tensors, as F.layer_norm computes it (fp32 statistics, the result rounded once)."""
    if x.dim() != 2 or not x.is_contiguous() or delta.shape != x.shape:
        raise ValueError("add_layer_norm takes contiguous [N, width] tensors of one shape")
    delta = delta.contiguous()
    n, width = x.shape
    summed, normed = torch.empty_like(x), torch.empty_like(x)
    if n:
        _add_layer_norm_kernel[(n,)](x, delta, weight, bias, summed, normed, width, eps,
                                     BLOCK=triton.next_power_of_2(width))
    return summed, normed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [N, 2 * width] (gate first), as [N, width]."""
    if gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError("silu_mul takes a contiguous [N, 2 * width] tensor")
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, width), dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = 1024
        _silu_mul_kernel[(n, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block)
    return out
