"""The batched LoRA product on the GPU (Triton's interpreter runs the kernels on a CPU host in the tests).

Two ways, by the number of token rows:
- A few rows (batch-1 decode, a warm request's tail): two gathering kernels. `shrink` computes each row's
  s = x @ A[slot]^T in fp32, split over blocks of the rank and of the input so that even one row spreads
  over the whole GPU (one program per row would stream a rank-256 adapter's A through one SM); each program
  writes its partial sum and `expand` adds them up in a fixed order (the result never depends on the
  schedule) before adding s @ B[slot]^T to the row of y in place. A row of slot 0 (the base model, or a
  CUDA graph's pad row) returns at once in both.
- More rows (batched decode, prefill chunks): the stacked product, two cuBLAS GEMMs over every adapter at
  once (x times all adapters' A, the other adapters' columns of each row set to zero by selection, times
  all adapters' B, added to y in its epilogue). Set, not multiplied by zero: another adapter's product
  with a row may overflow to Inf, and Inf x 0 is NaN; B's weights are finite in the serving dtype (checked
  at load, adapter.check_finite), so the zeros meet only finite values. Gathering per row would re-read
  B once per row (at 32 rows, 32 times an adapter's bytes); the stacked GEMMs read each adapter once, at
  (adapters) times one adapter's FLOPs, a few percent of the base product's for the ranks adapters have.
  Slot 0 is all zeros and is left out.
The gathering kernels read a row's own slot's weights only; slot 0 (the base model, and every CUDA graph
pad row: the runner gives them no other) reads none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GATHER_MAX_ROWS = 4  # more rows than this take the stacked GEMMs (the kernels re-read B per row)
_TARGET_PROGRAMS = 256  # enough programs to keep every SM of a large GPU reading
_MAX_SPLITS = 16  # each expand program re-reads every split's partial sums
_BLOCK_R = 32
_BLOCK_K = 128


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, part_ptr, x_stride, T, K, R, K_CHUNK,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot == 0:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < R
    split = tl.program_id(2)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    a_rows = a_ptr + (slot * R + r)[:, None] * K
    for k0 in range(split * K_CHUNK, tl.minimum(split * K_CHUNK + K_CHUNK, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + row * x_stride + k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(part_ptr + (split * T + row) * R + r, acc, mask=r_mask)


@triton.jit
def _expand_kernel(part_ptr, b_ptr, slot_ptr, y_ptr, y_stride, b_stride, T, N, R, SPLITS,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot == 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    splits = tl.arange(0, BLOCK_S)
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):  # once for ranks up to BLOCK_R: a row of B is one contiguous read
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < R
        # the shrink's partial sums of these ranks, all splits in one load, summed in a fixed order
        parts = tl.load(part_ptr + (splits[:, None] * T + row) * R + r[None, :],
                        mask=(splits[:, None] < SPLITS) & r_mask[None, :], other=0.0)
        s = tl.sum(parts, axis=0)
        b = tl.load(b_ptr + n[:, None] * b_stride + (slot * R + r)[None, :],
                    mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        delta += tl.sum(b * s[None, :], axis=1)
    y_row = y_ptr + row * y_stride + n
    y = tl.load(y_row, mask=n_mask, other=0.0)
    tl.store(y_row, (y.to(tl.float32) + delta).to(y.dtype), mask=n_mask)


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    slots: torch.Tensor, rank: int, adapter_rows: torch.Tensor | None = None) -> torch.Tensor:
    """reference.lora_add_reference's product, added to y IN PLACE (returns y). x [T, in] and y [T, out]
    with unit column stride; lora_a [S * rank, in] and lora_b [out, S * rank] contiguous; adapter_rows:
    LoRASlots.adapter_rows (made here when None)."""
    t, k = x.shape
    if t == 0:
        return y
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("lora_add_triton needs rows with unit column stride")
    if t > GATHER_MAX_ROWS:
        return lora_add_stacked(y, x, lora_a, lora_b, slots, rank, adapter_rows)
    n = y.shape[1]
    rank_blocks = triton.cdiv(rank, _BLOCK_R)
    splits = min(triton.cdiv(_TARGET_PROGRAMS, t * rank_blocks), triton.cdiv(k, _BLOCK_K), _MAX_SPLITS)
    k_chunk = triton.cdiv(triton.cdiv(k, splits), _BLOCK_K) * _BLOCK_K
    splits = triton.cdiv(k, k_chunk)
    partial = torch.empty(splits, t, rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(t, rank_blocks, splits)](x, lora_a, slots, partial, x.stride(0), t, k, rank, k_chunk,
                                             BLOCK_R=_BLOCK_R, BLOCK_K=_BLOCK_K)
    # narrow column blocks over the whole rank: many programs, each reading whole rows of B at once
    block_r = min(max(16, triton.next_power_of_2(rank)), 256)
    block_n = max(8, 4096 // block_r)
    _expand_kernel[(t, triton.cdiv(n, block_n))](partial, lora_b, slots, y, y.stride(0), lora_b.stride(0),
                                                 t, n, rank, splits, BLOCK_R=block_r, BLOCK_N=block_n,
                                                 BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return y


def lora_add_stacked(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     slots: torch.Tensor, rank: int,
                     adapter_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The product for many rows in two GEMMs over every adapter (slot 1 on), added to y in place. The
    adapters' inner product s is rounded to the activations' dtype between them, as PEFT's does.
    adapter_rows: [T, adapters] one-hot of each row's adapter in x's dtype (LoRASlots.adapter_rows, made
    once per forward; made here when None)."""
    a, b = lora_a[rank:], lora_b[:, rank:]  # slot 0, the base model, is all zeros
    adapters = a.shape[0] // rank
    if adapters == 0:
        return y
    if adapter_rows is None:
        adapter_rows = one_hot_adapters(slots, adapters, x.dtype)
    shrunk = torch.mm(x, a.T).view(x.shape[0], adapters, rank)
    shrunk.masked_fill_(adapter_rows[:, :adapters, None] == 0, 0)  # selected: Inf x 0 would be NaN
    return y.addmm_(shrunk.view(x.shape[0], adapters * rank), b.T)


def one_hot_adapters(slots: torch.Tensor, adapters: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, adapters]: 1 where row t runs adapter i (slot i + 1), else 0."""
    ids = torch.arange(1, adapters + 1, device=slots.device)
    return (slots[:, None] == ids[None, :]).to(dtype)
