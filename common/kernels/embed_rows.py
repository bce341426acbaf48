"""The kernel of decoder_svc/runner/embed_rows.py: a graph step's input embeddings in one launch.

Only imported on GPU paths or under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_HIDDEN = 2048  # embedding columns per program (a 4096-wide row takes two programs)


@triton.jit
def _embed_rows_kernel(out_ptr, weight_ptr, ids_ptr, pending_rows_ptr, pending_samples_ptr, last_ptr,
                       hidden, out_stride, weight_stride, num_pending,
                       BLOCK_PENDING: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    # Is this row pending? Its sample's row in the last step's output, or -1.
    p = tl.arange(0, BLOCK_PENDING)
    rows = tl.load(pending_rows_ptr + p, mask=p < num_pending, other=-1)
    samples = tl.load(pending_samples_ptr + p, mask=p < num_pending, other=-1)
    source = tl.max(tl.where(rows == row, samples, -1), axis=0)
    known = tl.load(ids_ptr + row)
    sampled = tl.load(last_ptr + tl.maximum(source, 0), mask=source >= 0, other=0)
    token = tl.where(source >= 0, sampled, known).to(tl.int64)
    if part == 0:
        tl.store(ids_ptr + row, token, mask=source >= 0)
    cols = part * BLOCK_H + tl.arange(0, BLOCK_H)
    values = tl.load(weight_ptr + token * weight_stride + cols, mask=cols < hidden)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + cols, values, mask=cols < hidden)


def embed_rows(out: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
               pending: tuple[torch.Tensor, torch.Tensor] | None, last_tokens: torch.Tensor | None) -> None:
    """embed_rows.py's embed_rows on the device. Every tensor's last dim is contiguous."""
    tokens, hidden = out.shape
    if tokens == 0:
        return
    if weight.stride(1) != 1 or out.stride(1) != 1 or input_ids.stride(0) != 1:
        raise ValueError("weight, out and input_ids need a contiguous last dim")
    rows, samples = pending if pending is not None else (input_ids[:0], input_ids[:0])
    last = last_tokens if last_tokens is not None else input_ids
    _embed_rows_kernel[(tokens, triton.cdiv(hidden, BLOCK_HIDDEN))](
        out, weight, input_ids, rows, samples, last, hidden, out.stride(0), weight.stride(0), rows.shape[0],
        BLOCK_PENDING=max(triton.next_power_of_2(rows.shape[0]), 16), BLOCK_H=BLOCK_HIDDEN, num_warps=4)
