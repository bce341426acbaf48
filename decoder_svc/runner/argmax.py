"""Greedy token choice: each row's argmax over the vocabulary, exactly as torch.argmax picks it.

torch's argmax of one decode row is a single-block reduction (some 10 us for 32000 logits on an H200),
and the sampler first widened the bf16 logits to fp32 (another kernel). Here the logits are read as they
are, in two small launches: every program takes one chunk of one row and keeps its best (value, first
index), then one program per row picks among its chunks. Chunks run on many SMs, so a 152k vocabulary
costs about what a 32k one does.

The order is torch's: a larger value wins, NaN above everything (+inf included), ties and equal NaNs go
to the lowest index, -0.0 equals +0.0. Values are compared as integers: fp32 bits with the magnitude of
negatives flipped sort like the floats.

Triton on CUDA tensors (common/kernels/argmax.py); torch.argmax elsewhere (and under TRITON_INTERPRET=1
tests call the kernels through `triton_argmax`).
"""

from __future__ import annotations

import torch

CHUNK = 4096  # logits per program: 32 per thread at 4 warps, one round of vector loads


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] logits (any float dtype) -> int64 [rows]: torch.argmax(logits.float(), dim=-1)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got {tuple(logits.shape)}")
    if not logits.is_cuda or logits.shape[0] == 0 or logits.shape[1] == 0:
        return logits.argmax(dim=-1)
    return triton_argmax(logits)


def triton_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax_rows through the two Triton kernels (a CUDA tensor, or any under TRITON_INTERPRET=1)."""
    from common.kernels import argmax as kernels

    return kernels.argmax(logits, CHUNK)
