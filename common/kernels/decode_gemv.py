"""One-row weight products with their input op fused in: batch-1 decode's matrix products in Triton.

At one token a decoder layer is four weight products, each preceded by a small op: RMS norm (with the
residual add) before q/k/v and before gate/up, nothing before o, SiLU(gate) x up before down. Each
product streams its whole weight once, and at this size every separate kernel costs a launch and a
ramp. Here one kernel does both: every program streams BLOCK_N weight rows over all K columns and
computes the activation chunk it multiplies with on the fly (the RMS norm's sum of squares is a first
pass over the K activations, which sit in L2), rounding where HF rounds (elementwise.py's kernels). The
weight may be bf16/fp16 or FP8 with one scale per output row (applied once at the end), so one code
path serves both.

Whether this beats the separate op + cuBLAS depends on the shape and the GPU, so it is measured, not
assumed: decoder_svc/model/kernel_dispatch.py times both for a projection at start-up (before the CUDA
graphs are captured) and records the winner; `MMSERVE_DECODE_GEMV=on|off` forces one side (benchmarks'
A/B). Only rows == 1 is taken; everything else goes the unfused way.

Only imported on GPU paths or under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
import triton.testing

from common.kernels.elementwise import _round
from common.kernels.pdl import launch_options, release_dependents, wait_for_inputs

PLAIN, RMS_NORM, SILU_MUL = 0, 1, 2  # the op fused before the product
PROLOGUE_NAMES = {PLAIN: "plain", RMS_NORM: "rms_norm", SILU_MUL: "silu_mul"}


@triton.jit
def _activation(x_ptr, res_ptr, cols, k_mask, HAS_RESIDUAL: tl.constexpr, dtype: tl.constexpr):
    # h = x (+ residual, one rounding to the dtype as torch's add), as a dtype tensor.
    h = tl.load(x_ptr + cols, mask=k_mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + cols, mask=k_mask, other=0.0)
        h = _round(h.to(tl.float32) + r.to(tl.float32), dtype)
    return h


@triton.jit
def _input_tile(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, cols, k_mask, K, inv_rms, pid,
                PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, dtype: tl.constexpr):
    # The product's input over `cols` in fp32, with its op applied (rounded to the dtype as HF does).
    if PROLOGUE == 1:
        h = _activation(x_ptr, res_ptr, cols, k_mask, HAS_RESIDUAL, dtype)
        if HAS_RESIDUAL:  # program 0 keeps the new residual stream
            tl.store(new_res_ptr + cols, h, mask=k_mask & (pid == 0))
        normed = _round(h.to(tl.float32) * inv_rms, dtype).to(tl.float32)
        g = tl.load(norm_w_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
        a = _round(normed * g, dtype).to(tl.float32)
    elif PROLOGUE == 2:  # x is cat(gate, up) of 2K values
        gate = tl.load(x_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + cols, mask=k_mask, other=0.0).to(tl.float32)
        act = _round(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
        a = _round(act * up, dtype).to(tl.float32)
    else:
        a = tl.load(x_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
    return a


@triton.jit
def _decode_gemv_kernel(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
                        N, K, stride_wn, eps,
                        PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, W_SCALED: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    # The first weight tile is loaded before waiting for the kernel before (weights are never written:
    # pdl.py), so the first K block is peeled off the loop.
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    w = tl.load(w_ptrs, mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)
    wait_for_inputs()
    inv_rms = 0.0
    if PROLOGUE == 1:
        # First pass: the norm's statistic over all K activations (each program; they are L2-resident).
        sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + rk
            hf = _activation(x_ptr, res_ptr, cols, cols < K, HAS_RESIDUAL, dtype).to(tl.float32)
            sq += hf * hf
        inv_rms = tl.math.rsqrt(tl.sum(sq, axis=0) / K + eps)
    a = _input_tile(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, rk, rk < K, K, inv_rms, pid, PROLOGUE,
                    HAS_RESIDUAL, dtype)
    acc = w.to(tl.float32) * a[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + rk
        k_mask = cols < K
        a = _input_tile(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, cols, k_mask, K, inv_rms, pid, PROLOGUE,
                        HAS_RESIDUAL, dtype)
        w_ptrs += BLOCK_K
        wk = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += wk * a[None, :]
    release_dependents()  # the next product may start loading its weights while this one ends
    out = tl.sum(acc, axis=1)
    if W_SCALED:
        out = out * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, out.to(dtype), mask=n_mask)


def _configs() -> list[triton.Config]:
    # Few rows per program keep enough programs to fill 132 SMs at N = 3584; wide K tiles keep many
    # bytes in flight per program.
    shapes = ((2, 1024, 4), (4, 512, 4), (4, 1024, 4), (4, 1024, 8), (8, 256, 4), (8, 512, 4),
              (8, 512, 8), (16, 256, 4), (16, 512, 8), (32, 128, 4), (32, 256, 8))
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=2) for n, k, w in shapes]


_tuned_kernel = triton.autotune(
    configs=_configs(), key=["N", "K", "PROLOGUE", "HAS_RESIDUAL", "W_SCALED"],
    do_bench=functools.partial(triton.testing.do_bench, warmup=10, rep=40))(_decode_gemv_kernel)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # the interpreter cannot autotune


@dataclass(frozen=True)
class GemvWeight:
    """What the kernel streams: weight [N, K] (bf16/fp16, or FP8 with fp32 `scale` [N]) and a bias."""

    weight: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor | None


def fused_gemv(x: torch.Tensor, w: GemvWeight, prologue: int = PLAIN, residual: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               config: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [1, N], new residual or None) for one activation row x.

    PLAIN: x [1, K] @ W^T (on Hopper, without `config`: stream_gemv, the TMA-streamed GEMV). RMS_NORM:
    rms_norm(x (+ residual)) * norm_weight @ W^T; with a residual the new residual stream x + residual is
    returned in a NEW tensor (inputs are never written), without one it is x. SILU_MUL: x [1, 2K] =
    cat(gate, up), silu(gate) * up @ W^T. FP8 weights are scaled per row. `config` fixes BLOCK_N /
    BLOCK_K / num_warps (tests; the interpreter), else they are autotuned.
    """
    n, k = w.weight.shape
    if x.shape[0] != 1 or x.shape[-1] != (2 * k if prologue == SILU_MUL else k):
        raise ValueError(f"one row of {k} (or 2x{k} for silu_mul) activations expected, got {tuple(x.shape)}")
    x = x.contiguous()
    if prologue == PLAIN and config is None and not _INTERPRETED:
        # Nothing to fuse: on Hopper the TMA-streamed GEMV (stream_gemv.py) streams the weight faster.
        from common.kernels import stream_gemv as sg

        if sg.usable(x, w.weight):
            return sg.stream_gemv(x, w.weight, w.scale, w.bias), None
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    new_residual = None
    if prologue == RMS_NORM:
        new_residual = x if residual is None else torch.empty_like(x)
        if residual is not None:
            residual = residual.contiguous()
    def given(t: torch.Tensor | None) -> torch.Tensor:
        return x if t is None else t  # a pointer the kernel never reads when its flag is off

    args = (x, given(residual), given(new_residual), given(norm_weight), w.weight, given(w.scale),
            given(w.bias), out, n, k, w.weight.stride(0), eps)
    flags = dict(PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, W_SCALED=w.scale is not None,
                 HAS_BIAS=w.bias is not None)
    if config is None and _INTERPRETED:
        config = {"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 4}
    if config is not None:
        grid = (triton.cdiv(n, config["BLOCK_N"]),)
        _decode_gemv_kernel[grid](*args, **flags, **config, **launch_options())
    else:
        _tuned_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags, **launch_options())
    return out, new_residual
