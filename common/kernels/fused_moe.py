"""Mixture-of-experts feed-forward on the GPU: token-to-expert sort into block-aligned groups, one grouped
GEMM kernel over all experts (used for gate/up and again for down, the second making the SwiGLU of the
first's output as it reads it), weighted combine.

The layout follows the idea of vLLM's and SGLang's `fused_moe` (the code is this project's own):

- `align_to_blocks` (moe_align.py) sorts the T x top_k (token, expert) assignments by expert and pads each
  expert's run to a multiple of BLOCK_M rows, so a program multiplies one BLOCK_M x K tile of rows by one
  expert's weight tile; blocks past the last run carry expert -1 and return at once (at one token only
  the top_k chosen experts' weights are read). Nothing is read back to the host: graph-capture safe.
- `_grouped_gemm_kernel` computes, for each sorted row r = (token t, slot k) of a block of expert e,
  out[r] = A[row of r] @ W[e]^T (W[e] is [N, K], the checkpoint's expert layout), accumulating in fp32;
  A's row is t for the first product (the token's hidden state, shared by its top_k slots) and r itself
  for the second (that slot's intermediate, silu(g) * u of the first product's halves, rounded as
  torch's F.silu(g) * u rounds). With MUL_WEIGHT the fp32 result is scaled by the slot's routing weight
  before the one rounding to the output dtype.
- FP8 experts (`--quantization fp8`: float8_e4m3fn weights, one fp32 scale per expert and output channel,
  decoder_svc/model/quant/experts.py): the kernel widens each weight tile to the activations' dtype and
  scales the fp32 accumulator by its columns' scales once, after the K loop (before the routing weight).
- The combine sums each token's top_k weighted rows (in slot order, fp32, one rounding).
- Which tiling a batch takes, and whether a prefill takes torch's grouped GEMM instead
  (moe_grouped_mm.py), is measured, not guessed: moe_tuning.py, whose `moe_experts` the layer calls.
- Every launch is a programmatic dependent launch on Hopper (pdl.py): it starts while the kernel before
  drains and waits before its first read (the products have nothing to stream before the sort's output).

Only imported on GPU paths or under TRITON_INTERPRET=1 (tests/engine/test_fused_moe.py runs it in
Triton's interpreter against the torch reference; tests/gpu/test_fused_moe_gpu.py in bf16 on a GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.kernels.moe_align import BlockAlignment, align_to_blocks
from common.kernels.pdl import (
    launch_options,
    release_dependents,
    small_kernel_launch_options,
    wait_for_inputs,
)


@triton.jit
def _a_tile(ptrs, mask, up_offset, A_SWIGLU: tl.constexpr):
    # A's tile as stored, or with A_SWIGLU silu(g) * u of the stored halves (u at ptrs + up_offset), each
    # rounded to A's dtype as torch's two elementwise ops round
    a = tl.load(ptrs, mask=mask, other=0.0)
    if A_SWIGLU:
        up = tl.load(ptrs + up_offset, mask=mask, other=0.0)
        g = a.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(a.dtype)
        a = (silu.to(tl.float32) * up.to(tl.float32)).to(a.dtype)
    return a


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_rows_ptr, block_expert_ptr, weights_ptr, w_scale_ptr,
    N, K, num_rows,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_se, stride_sn,
    TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr, A_SWIGLU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    W_SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr = False,
):
    """out[r, :] = A[a(r), :] @ W[e]^T (* w_scale[e]) (* weights[r]) for the BLOCK_M sorted rows r of this
    program's block, e its expert; a(r) = r // TOP_K when A_PER_TOKEN, else r. A_SWIGLU: A's row is
    silu(g) * u of the stored row's halves [g | u] (K columns each), each rounded to A's dtype as torch's
    two elementwise ops round. W_SCALED: W is FP8, widened to A's dtype per tile, and w_scale
    [experts, N] (strides se, sn) scales the accumulator's columns. SWAP_AB: the same values computed as
    (W . A^T)^T (decode blocks of a few rows). Programs: (blocks, N / BLOCK_N)."""
    # launched early (pdl.py); nothing is read before the wait: which expert's weights to stream is
    # itself the sort's output
    wait_for_inputs()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_rows_ptr + offs_m)
    row_ok = rows < num_rows
    if A_PER_TOKEN:
        a_rows = rows // TOP_K
    else:
        a_rows = rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    if SWAP_AB:
        # out^T = W . A^T: the weight tile is the product's left operand (its rows the MMA's wide M, a
        # converted FP8 tile fed from registers), the block's few rows its narrow N
        a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_k[:, None] * stride_ak  # [BLOCK_K, BLOCK_M]
        w_ptrs = w_base + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [BLOCK_N, BLOCK_K]
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k + k0 < K
            a = _a_tile(a_ptrs, k_ok[:, None] & row_ok[None, :], K * stride_ak, A_SWIGLU)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if W_SCALED:
                w = w.to(a.dtype)  # e4m3 values are exact in bf16, fp16 and fp32
            acc_t += tl.dot(w, a)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        acc = tl.trans(acc_t)
    else:
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k + k0 < K
            a = _a_tile(a_ptrs, row_ok[:, None] & k_ok[None, :], K * stride_ak, A_SWIGLU)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if W_SCALED:
                w = w.to(a.dtype)
            acc += tl.dot(a, w)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
    release_dependents()  # after the main loop, as the other products (pdl.py)
    if W_SCALED:
        w_scale = tl.load(w_scale_ptr + expert.to(tl.int64) * stride_se + offs_n * stride_sn, mask=n_ok,
                          other=0.0)
        acc = acc * w_scale[None, :]
    if MUL_WEIGHT:
        scale = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of the grouped GEMM (BLOCK_M is also the alignment of each expert's run)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False  # the weight tile as the MMA's left operand (_grouped_gemm_kernel's SWAP_AB)


def default_config(tokens: int) -> GemmConfig:
    """Tiles by batch size: small row blocks while each expert sees few rows (decode), larger after (the
    fastest of bench/moe_tiling.py's candidates at 512 and 1536 tokens on an H100; the largest tile only
    where the card's shared memory holds its three stages)."""
    if tokens <= 32:
        return GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if tokens <= 512:
        return GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
    if _shared_memory_bytes() >= LARGE_TILE_SHARED_BYTES:
        return GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
    return GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


LARGE_TILE_SHARED_BYTES = 160 * 1024  # 128x64 + 64x256 bf16 tiles, three stages: 144 KiB and the rest


@functools.cache
def _shared_memory_bytes() -> int:
    """The current GPU's shared memory per block (unbounded without one: the interpreter takes any tile)."""
    if not torch.cuda.is_available():
        return 1 << 30
    device = torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]


def check_expert_scales(gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor | None,
                        down_scale: torch.Tensor | None) -> None:
    """Raise ValueError unless each FP8 scale given is [experts, N, ...] of its weight [experts, N, K]."""
    for name, w, scale in (("gate_up", gate_up, gate_up_scale), ("down", down, down_scale)):
        if scale is not None and tuple(scale.shape[:2]) != tuple(w.shape[:2]):
            raise ValueError(f"{name} expert scales {tuple(scale.shape)} do not fit weights "
                             f"{tuple(w.shape)}")


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, alignment: BlockAlignment, num_rows: int,
                 top_k: int, a_per_token: bool, config: GemmConfig,
                 row_weights: torch.Tensor | None = None,
                 weight_scale: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """[num_rows, N] (rows in flat assignment order): each assignment's A row times its expert's weight
    [N, K] transposed, scaled by row_weights [num_rows] when given. a: [T, K] (a_per_token) or
    [num_rows, K], or with `swiglu` [num_rows, 2K] whose halves [g | u] make the row silu(g) * u;
    weights: [experts, N, K], FP8 when weight_scale (fp32 [experts, N, 1], per output channel) is given."""
    num_n, k = weights.shape[1], weights.shape[2]
    if a.shape[1] != (2 * k if swiglu else k):
        raise ValueError(f"rows of {a.shape[1]} columns for experts of {k} inputs (swiglu={swiglu})")
    out = torch.empty(num_rows, num_n, dtype=a.dtype, device=a.device)
    blocks = alignment.block_expert.numel()
    grid = (blocks, triton.cdiv(num_n, config.block_n))
    scale = row_weights if row_weights is not None else out  # never read without MUL_WEIGHT
    w_scale = weight_scale if weight_scale is not None else out  # never read without W_SCALED
    if weight_scale is not None and tuple(weight_scale.shape[:2]) != tuple(weights.shape[:2]):
        raise ValueError(f"expert scales {tuple(weight_scale.shape)} do not fit weights "
                         f"{tuple(weights.shape)}")
    _grouped_gemm_kernel[grid](
        a, weights, out, alignment.sorted_rows, alignment.block_expert, scale, w_scale,
        num_n, k, num_rows,
        a.stride(0), a.stride(1), weights.stride(0), weights.stride(1), weights.stride(2),
        out.stride(0), out.stride(1), w_scale.stride(0), w_scale.stride(1),
        TOP_K=top_k, A_PER_TOKEN=a_per_token, A_SWIGLU=swiglu, MUL_WEIGHT=row_weights is not None,
        W_SCALED=weight_scale is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SWAP_AB=config.swap_ab,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(),
    )
    return out


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: GemmConfig | None = None,
              gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The experts' SwiGLU feed-forward of x [T, H], combined: sum over k of topk_weights[t, k] *
    down[e](silu(g) * u) with (g, u) = gate_up[e] @ x[t] halves, e = topk_ids[t, k].
    gate_up: [experts, 2 * I, H] (gate rows first); down: [experts, H, I]. FP8 experts: both float8_e4m3fn
    with gate_up_scale [experts, 2 * I, 1] and down_scale [experts, H, 1] (fp32, per output channel).
    Returns [T, H] in x's dtype, through `config`'s tiles (default_config's when None; the layer's choice
    of tiling and path is moe_tuning.moe_experts')."""
    tokens, top_k = topk_ids.shape
    num_rows = tokens * top_k
    if num_rows == 0:
        return torch.zeros_like(x)
    config = config or default_config(tokens)
    alignment = align_to_blocks(topk_ids, gate_up.shape[0], config.block_m)
    h = grouped_gemm(x, gate_up, alignment, num_rows, top_k, True, config, weight_scale=gate_up_scale)
    # the down product reads h's halves and makes silu(g) * u itself (two elementwise launches saved)
    out = grouped_gemm(h, down, alignment, num_rows, top_k, False, config, topk_weights.reshape(-1),
                       down_scale, swiglu=True)
    return combine(out, tokens, top_k)


@triton.jit
def _combine_kernel(rows_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, h] = sum over k (in slot order) of rows[t * TOP_K + k, h], in fp32, rounded once.
    Programs: (tokens, H / BLOCK_H)."""
    wait_for_inputs()
    release_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (t * TOP_K + k) * H + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine(rows: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """[tokens, H]: each token's top_k weighted expert rows (rows [tokens * top_k, H], contiguous) summed
    in one launch."""
    hidden = rows.shape[1]
    out = torch.empty(tokens, hidden, dtype=rows.dtype, device=rows.device)
    block = min(triton.next_power_of_2(hidden), 1024)
    _combine_kernel[(tokens, triton.cdiv(hidden, block))](rows, out, hidden, TOP_K=top_k, BLOCK_H=block,
                                                          **small_kernel_launch_options())
    return out
