"""A batch-invariant matrix product: row i of x @ w is the same bits whatever the other rows are.

cuBLAS picks its kernel, its tiles and its split of K by the shape, so one row's products sum in another
order when the batch grows (a decode step of 1 row against one of 40, a prompt in one chunk against two).
This kernel never changes with M: one tile shape per (N, K, dtype) (`invariant_tiles`), no split of K,
each output tile summed over K in the same order, and M kept out of the compiled specialisations
(`do_not_specialize`), so the compiled code is one for every batch. It costs throughput against cuBLAS
(BENCHMARKS.md measures it); the decoder's deterministic mode takes it for every product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class InvariantTiles:
    """The one tile shape a (N, K, dtype) product takes, whatever M is."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def invariant_tiles(n: int, k: int, dtype: torch.dtype) -> InvariantTiles:
    """64-row tiles (the smallest Hopper's warpgroup products take whole); 32-deep K steps in fp32 (twice
    the bytes a step), 64 otherwise. Never a function of M."""
    del n, k  # one shape for all today; the signature says what it may depend on
    return InvariantTiles(64, 64, 32 if dtype == torch.float32 else 64)


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                             stride_bn, stride_cm, stride_cn, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Column tiles vary fastest: consecutive programs share their rows of a (decode: one tile of rows).
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    rows = (pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) in a's dtype, fp32 sums; any strides. Row i of the result depends
    on row i of `a`, b and bias only, never on M or the other rows."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"invariant_matmul takes [M, K] @ [K, N], got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"invariant_matmul takes one dtype, got {a.dtype} and {b.dtype}")
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty(m, n, dtype=a.dtype, device=a.device) if out is None else out
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
    tiles = invariant_tiles(n, k, a.dtype)
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _invariant_matmul_kernel[grid](
        a, b, bias if bias is not None else a, out, m, n, k, a.stride(0), a.stride(1), b.stride(0),
        b.stride(1), out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
        IEEE=a.dtype == torch.float32, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
