"""The batched LoRA product in Triton (GPU; Triton's interpreter on a CPU host in the tests).

Two kernels, one program per token row (and block of output columns): `shrink` reads the row's slot and
computes s = x @ A[slot]^T (R values, fp32) over the input in blocks; `expand` adds s @ B[slot]^T to the
row of y in place. A row of slot 0 (the base model, or a CUDA graph's pad row) returns at once in both.
Each row reads its adapter's A and B: at decode that is the least traffic possible (the rows of one
adapter share them through the cache); a long prefill re-reads them per row from L2 (ranks are small).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, s_ptr, x_stride, s_stride, K, R,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot == 0:
        return
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    a_rows = a_ptr + (slot * R + r)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + row * x_stride + k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(s_ptr + row * s_stride + r, acc, mask=r_mask)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, slot_ptr, y_ptr, s_stride, y_stride, b_stride, N, R,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot == 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    s = tl.load(s_ptr + row * s_stride + r, mask=r_mask, other=0.0)
    b = tl.load(b_ptr + n[:, None] * b_stride + (slot * R + r)[None, :],
                mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(b * s[None, :], axis=1)
    y_row = y_ptr + row * y_stride + n
    y = tl.load(y_row, mask=n_mask, other=0.0)
    tl.store(y_row, (y.to(tl.float32) + delta).to(y.dtype), mask=n_mask)


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    slots: torch.Tensor, rank: int) -> torch.Tensor:
    """reference.lora_add_reference's product, added to y IN PLACE (returns y). x [T, in] and y [T, out]
    with unit column stride; lora_a [S * rank, in] and lora_b [out, S * rank] contiguous."""
    t, k = x.shape
    n = y.shape[1]
    if t == 0:
        return y
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("lora_add_triton needs rows with unit column stride")
    shrunk = torch.empty(t, rank, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(rank))
    _shrink_kernel[(t,)](x, lora_a, slots, shrunk, x.stride(0), shrunk.stride(0), k, rank,
                         BLOCK_R=block_r, BLOCK_K=max(16, min(128, 4096 // block_r)))
    block_n = 64
    _expand_kernel[(t, triton.cdiv(n, block_n))](shrunk, lora_b, slots, y, shrunk.stride(0), y.stride(0),
                                                  lora_b.stride(0), n, rank, BLOCK_R=block_r, BLOCK_N=block_n)
    return y
