"""FP8 weight products on the GPU.

Decode reads every weight once per step at a few rows, so there FP8 weights (half the bytes of bf16)
should stream at the memory bandwidth; the kernels below differ in how many loads they keep in flight.

- One row (batch-1 decode): `_gemv_kernel`, no tensor cores: each program streams BLOCK_N weight rows
  over all of K, accumulates elementwise in fp32 and reduces once at the end. On Hopper it is launched
  with programmatic dependent launch (`pdl.py`): its first weight tile loads while the
  kernel before it ends.
- 2..64 rows (decode with several streams): the split-K kernel and its stream-K form
  (fp8_split_k.py), per-channel weights and blocks whose columns are a multiple of 128; other block
  sizes keep the one-pass kernel.
- `_weight_only_kernel` (one pass over K, programs over N blocks only): more than 64 rows of block-scaled
  weights, and the old 2..64-row path that `weight_only_fp8(split_k=False)` still runs (benchmarks' A/B).
- Large batches (prefill) of per-channel weights: `torch._scaled_mm`, FP8 x FP8 on the tensor cores
  (twice the bf16 rate on Hopper), with the activations quantized per token on the fly.

Only imported on GPU paths (TritonOps.fp8_linear) or under TRITON_INTERPRET=1: the CPU tests
(tests/quant/) run the kernels in Triton's interpreter; tests/gpu/test_fp8_gpu.py runs every kernel.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from common.kernels.fp8_layout import FP8_DTYPE, FP8_MAX, ScaleBlock
from common.kernels.fp8_split_k import KEY, TUNING, k_range_product, split_k_fp8
from common.kernels.pdl import launch_options, release_dependents, wait_for_inputs

# Rows up to which the weight-only kernels run; above, the activations are quantized per token and the
# product is FP8 x FP8 (`scaled_mm_fp8`). 64 is the first measurement's choice (the kernels of before);
# MMSERVE_FP8_WEIGHT_ONLY_ROWS moves it for an A/B (bench.fp8_gemv times both at every row count).
SMALL_M = int(os.environ.get("MMSERVE_FP8_WEIGHT_ONLY_ROWS", "64"))
# Rows taken by the streaming GEMV (0: none, one row goes to split-K too). Measured on the H200
# (bench.fp8_gemv, llava-1.5-7b's matrices at one row): the GEMV 6.4-28.8 us per product (2.6-3.1 TB/s)
# against split-K 11.5-33.6 us, and 350 against 307 tok/s at batch 1; a variant reading the weights once for
# up to 8 rows was slower. MMSERVE_FP8_GEMV_ROWS=0 sends one row to split-K (the A/B).
GEMV_ROWS = int(os.environ.get("MMSERVE_FP8_GEMV_ROWS", "1"))
# Block-scaled weights take the split-K kernel when their scale blocks span a multiple of this many columns
# (every split-K BLOCK_K divides it).
SPLIT_K_BLOCK_COLS = 128


def _configs(block_ks: tuple[int, ...]) -> list[triton.Config]:
    # Few configurations, timed briefly: every (rows bucket, matrix) pair is tuned once at start-up,
    # while the CUDA graphs are captured, and that must take seconds, not minutes.
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=4, num_stages=4)
            for n in (16, 32, 64) for k in block_ks]


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K,
                        stride_xm, stride_wn, stride_sn, stride_sk, stride_om,
                        SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, PER_CHANNEL: tl.constexpr,
                        HAS_BIAS: tl.constexpr, M_BUCKET: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Programs over (N blocks, M blocks): at decode there is one M block and N / BLOCK_N programs, each
    # streaming its BLOCK_N weight rows once. M_BUCKET only keys the autotuner.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    acc = k_range_product(x_ptr, w_ptr, s_ptr, rm, rn, rk, m_mask, n_mask, 0, K, K, stride_xm,
                           stride_wn, stride_sn, stride_sk, SCALE_ROWS, SCALE_COLS, PER_CHANNEL, BLOCK_M,
                           BLOCK_N, BLOCK_K)
    if PER_CHANNEL:
        acc = acc * tl.load(s_ptr + rn * stride_sn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemv_tile(acc, w, x, s_ptr, rn, n_mask, k0, stride_sn, stride_sk, SCALE_ROWS: tl.constexpr,
               SCALE_COLS: tl.constexpr, PER_CHANNEL: tl.constexpr):
    # acc [BLOCK_N, BLOCK_K] += one K block's products in fp32 (a block-scaled weight's scale applied here).
    if PER_CHANNEL:
        acc += w.to(tl.float32) * x[None, :]
    else:
        s = tl.load(s_ptr + (rn // SCALE_ROWS) * stride_sn + (k0 // SCALE_COLS) * stride_sk,
                    mask=n_mask, other=0.0)
        acc += w.to(tl.float32) * x[None, :] * s[:, None]
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_sk,
                 stride_om, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, PER_CHANNEL: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One activation row (batch-1 decode): no tensor cores, just streaming. Each program owns BLOCK_N
    # weight rows, accumulates products elementwise over K in fp32 registers and reduces once at the end.
    # The first weight tile is loaded before waiting for the kernel before (weights are never written:
    # pdl.py), so the first K block is peeled off the loop.
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + m * stride_xm + rk
    w = tl.load(w_ptrs, mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)
    wait_for_inputs()
    x = tl.load(x_ptrs, mask=rk < K, other=0.0).to(tl.float32)
    acc = _gemv_tile(tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32), w, x, s_ptr, rn, n_mask, 0, stride_sn,
                     stride_sk, SCALE_ROWS, SCALE_COLS, PER_CHANNEL)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _gemv_tile(acc, w, x, s_ptr, rn, n_mask, k0, stride_sn, stride_sk, SCALE_ROWS, SCALE_COLS,
                         PER_CHANNEL)
    release_dependents()  # the next product may start loading its weights while this one ends
    out = tl.sum(acc, axis=1)
    if PER_CHANNEL:
        out = out * tl.load(s_ptr + rn * stride_sn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rn, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def _gemv_configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
            for n, k, w, st in ((8, 512, 4, 3), (16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 8, 3),
                                (32, 256, 8, 3), (8, 1024, 8, 2), (4, 1024, 4, 3), (32, 128, 4, 4),
                                (32, 64, 4, 4), (32, 32, 4, 4))]


def _fit_scale_blocks(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    # A K block must lie inside one scale column: BLOCK_K divides SCALE_COLS (per channel: any).
    if kwargs.get("PER_CHANNEL", named_args.get("PER_CHANNEL")):
        return configs
    cols = kwargs.get("SCALE_COLS", named_args.get("SCALE_COLS"))
    return [c for c in configs if cols % c.kwargs["BLOCK_K"] == 0] or configs[:0]


_per_channel_kernel = triton.autotune(configs=_configs((256, 512)), key=KEY, **TUNING)(_weight_only_kernel)
_gemv = triton.autotune(configs=_gemv_configs(), key=KEY[1:], **TUNING,
                        prune_configs_by={"early_config_prune": _fit_scale_blocks})(
    triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_gemv_kernel))
_blocked_kernel = triton.autotune(configs=_configs((32, 64, 128)), key=KEY, **TUNING,
                                  prune_configs_by={"early_config_prune": _fit_scale_blocks}
                                  )(_weight_only_kernel)


def _triton_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                 bias: torch.Tensor | None) -> torch.Tensor:
    # `_gemv_kernel` for a few rows (one program row per activation row).
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), m)  # noqa: E731
    _gemv[grid](x, weight, scale, bias if bias is not None else x, out, n, k, x.stride(0), weight.stride(0),
                scale.stride(0), scale.stride(1) if scale.dim() == 2 else 0, out.stride(0),
                SCALE_ROWS=block.rows, SCALE_COLS=block.cols, PER_CHANNEL=block.is_per_channel(k),
                HAS_BIAS=bias is not None, **launch_options())
    return out


def _one_row(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
             bias: torch.Tensor | None, stream: bool | None) -> torch.Tensor:
    # One row of per-channel weights on Hopper: the TMA-streamed GEMV (stream_gemv.py) where it was
    # measured faster than `_gemv_kernel` for this shape (stream=None), or as told; else `_gemv_kernel`.
    if stream is not False and x.shape[0] == 1 and block.is_per_channel(x.shape[1]):
        from common.kernels import stream_gemv as sg

        if sg.usable(x, weight):
            def rival(w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
                return _triton_gemv(x, w, s.reshape(-1, 1), block, bias)

            config = sg.choose(x, weight, scale, bias, rival if stream is None else None,
                               "triton_gemv" if stream is None else "")
            if config is not None:
                return sg.stream_gemv(x, weight, scale, bias, config)
    return _triton_gemv(x, weight, scale, block, bias)


def weight_only_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                    bias: torch.Tensor | None, split_k: bool | None = None,
                    stream: bool | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16, unit column stride) @ (weight * scale)^T + bias -> [M, N] in x's dtype.

    GEMV_ROWS+1..SMALL_M rows: the split-K kernel (per-channel weights, and blocks whose columns are a
    multiple of 128); one row otherwise (or up to GEMV_ROWS): a GEMV (on Hopper, per-channel weights:
    the TMA-streamed one where measured faster; `stream` True / False forces it / the Triton one); more
    rows of other blocks: the one-pass kernel. `split_k=False` forces the kernels of before (benchmarks'
    A/B), True the split-K kernel at any row count."""
    m, k = x.shape
    n = weight.shape[0]
    per_channel = block.is_per_channel(k)
    if split_k is None:
        split_k = GEMV_ROWS < m <= SMALL_M and (per_channel or block.cols % SPLIT_K_BLOCK_COLS == 0)
    if split_k:
        return split_k_fp8(x, weight, scale, block, bias)
    if m == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m <= max(GEMV_ROWS, 1):  # one row of a scale layout split-K does not take: a GEMV
        return _one_row(x, weight, scale, block, bias, stream)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    s_stride_k = scale.stride(1) if scale.dim() == 2 else 0
    bucket = min(triton.next_power_of_2(max(m, 16)), 128)
    block_m = min(bucket, 64)
    if not per_channel and block.cols % 32:
        raise ValueError(f"FP8 scale blocks of {block.cols} columns are not a multiple of 32")
    kernel = _per_channel_kernel if per_channel else _blocked_kernel
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, block_m))  # noqa: E731
    kernel[grid](x, weight, scale, bias if bias is not None else x, out, m, n, k,
                 x.stride(0), weight.stride(0), scale.stride(0), s_stride_k, out.stride(0),
                 SCALE_ROWS=block.rows, SCALE_COLS=block.cols, PER_CHANNEL=per_channel,
                 HAS_BIAS=bias is not None, M_BUCKET=bucket, BLOCK_M=block_m)
    return out


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FP8_LIMIT: tl.constexpr,
                          BLOCK: tl.constexpr):
    # One program per row: its absolute maximum, then the row divided by amax / FP8_LIMIT. One launch
    # where torch takes five (abs, amax, divide, clamp, cast): at decode's row counts the launches, not
    # the bytes, are the cost.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_LIMIT, 1e-12)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + cols < K
        v = tl.load(x_ptr + row * stride_x + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(v / scale, -FP8_LIMIT), FP8_LIMIT)
        tl.store(q_ptr + row * stride_q + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], fp32 scales [M, 1]) with x ~= q * scale per row (dynamic, per token):
    scale = max(|row|) / FP8_MAX (at least 1e-12), q = clamp(row / scale)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scales, k, x.stride(0), q.stride(0), FP8_LIMIT=FP8_MAX,
                                    BLOCK=min(triton.next_power_of_2(k), 1024))
    return q, scales


def scaled_mm_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x @ (weight * scale)^T + bias with x quantized per token (dynamic scales), FP8 x FP8 on the
    tensor cores with per-row and per-column scales; per-channel weights only."""
    xq, x_scale = quantize_rows_fp8(x)
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), bias=bias,
                            out_dtype=x.dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GPU FP8 product for TritonOps (same contract as TorchOps.fp8_linear, looser rounding)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    k = x.shape[1]
    if block.is_per_channel(k) and x.shape[0] > SMALL_M and k % 16 == 0 and weight.shape[0] % 16 == 0:
        return scaled_mm_fp8(x, weight, scale, bias)
    return weight_only_fp8(x, weight, scale, block, bias)
