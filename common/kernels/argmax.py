"""The two kernels of decoder_svc/runner/argmax.py (greedy token choice): each chunk's best, then each
row's.

Only imported on GPU paths or under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_INT32_MAX = tl.constexpr(2**31 - 1)
_INT32_MIN = tl.constexpr(-(2**31))


@triton.jit
def _sort_key(x):
    # fp32 -> int32 that sorts like torch's argmax order: negatives' magnitude bits flipped, -0.0 as +0.0,
    # every NaN above +inf.
    x = x.to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)
    return tl.where(x != x, _INT32_MAX, key)


@triton.jit
def _chunk_best_kernel(logits_ptr, keys_ptr, index_ptr, vocab, row_stride, num_chunks,
                       CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * row_stride + cols, mask=cols < vocab, other=float("-inf"))
    keys = tl.where(cols < vocab, _sort_key(x), _INT32_MIN)
    best = tl.max(keys, axis=0)
    first = tl.min(tl.where(keys == best, cols, _INT32_MAX), axis=0)  # the lowest index among equals
    tl.store(keys_ptr + row * num_chunks + chunk, best)
    tl.store(index_ptr + row * num_chunks + chunk, first)


@triton.jit
def _row_best_kernel(keys_ptr, index_ptr, out_ptr, num_chunks, BLOCK_CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_CHUNKS)
    keys = tl.load(keys_ptr + row * num_chunks + c, mask=c < num_chunks, other=_INT32_MIN)
    index = tl.load(index_ptr + row * num_chunks + c, mask=c < num_chunks, other=_INT32_MAX)
    best = tl.max(keys, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(keys == best, index, _INT32_MAX), axis=0).to(tl.int64))


def argmax(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """int64 [rows]: each row's argmax (argmax.py's order). logits [rows, vocab], unit column stride."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, chunk)
    keys = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    index = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _chunk_best_kernel[(rows, num_chunks)](logits, keys, index, vocab, logits.stride(0), num_chunks,
                                          CHUNK=chunk, num_warps=4)
    _row_best_kernel[(rows,)](keys, index, out, num_chunks,
                              BLOCK_CHUNKS=max(triton.next_power_of_2(num_chunks), 16), num_warps=1)
    return out
