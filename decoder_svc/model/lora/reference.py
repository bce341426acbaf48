"""The batched LoRA product in plain torch: the reference the Triton kernels are tested against, and
the CPU implementation.

Every row is multiplied by every slot's A (one product [T, slots * R]), the columns of other slots are
masked to zero, and one product with every slot's B follows: (slots) times the work of one adapter, but
shapes that never depend on the rows' slots (graph-safe) and no gather of per-row weights. In fp32, cast
back to y's dtype once, as the kernels accumulate.
"""

from __future__ import annotations

import torch


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       slots: torch.Tensor, rank: int) -> torch.Tensor:
    """y + (x @ A[slot]^T) @ B[slot]^T per row. x [T, in], y [T, out], lora_a [S * rank, in],
    lora_b [out, S * rank], slots [T] int64 in [0, S). Returns a new tensor."""
    columns = torch.arange(lora_a.shape[0], device=x.device) // rank
    mask = slots[:, None] == columns[None, :]
    shrunk = (x.float() @ lora_a.float().T) * mask
    return y + (shrunk @ lora_b.float().T).to(y.dtype)
