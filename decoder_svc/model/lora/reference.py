"""The batched LoRA product in plain torch: the reference the Triton kernels are tested against, and
the CPU implementation.

Each adapter slot's product runs over every row, and each row then takes its own slot's rows by
selection (`torch.where`), never by multiplying the others by zero: 0 x NaN is NaN, so a NaN or an
overflow in one adapter (its weights, or its product with a row's activations) must reach only the rows
that run it. (slots) times the work of one adapter, but shapes that never depend on the rows' slots
(graph-safe) and no gather of per-row weights. In fp32, cast back to y's dtype once, as the kernels
accumulate.
"""

from __future__ import annotations

import torch


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       slots: torch.Tensor, rank: int) -> torch.Tensor:
    """y + (x @ A[slot]^T) @ B[slot]^T per row. x [T, in], y [T, out], lora_a [S * rank, in],
    lora_b [out, S * rank], slots [T] int64 in [0, S); a row of slot 0 (the base model) gets y's row
    exactly. Returns a new tensor."""
    xf = x.float()
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    for slot in range(1, lora_a.shape[0] // rank):  # slot 0, the base model, adds nothing
        cols = slice(slot * rank, (slot + 1) * rank)
        product = (xf @ lora_a[cols].float().T) @ lora_b[:, cols].float().T
        delta = torch.where((slots == slot)[:, None], product, delta)
    return y + delta.to(y.dtype)
