"""A MoE layer's experts through torch's grouped GEMM (`torch._grouped_mm`: CUTLASS's grouped kernels on
Hopper, a loop of products elsewhere), for prefill-sized batches, beside fused_moe's Triton kernels.

The (token, slot) assignments are sorted by expert (stable: token-major within an expert; moe_align's
kernels), the tokens' rows gathered in that order, and each expert's run multiplied by its weights with
no padding: the groups' ends (`offs`, int32, on the device) tell the kernel where runs start, so
nothing is read back to the host. Then SiLU(g) * u (elementwise.gated_act), the down product, the
routing weight (in the activations' dtype, as HF's loop weights each expert's output) and the rows put
back in assignment order, for fused_moe's `combine` to sum each token's top_k rows in fp32.

Only for weights in the activations' dtype (bf16/fp16 on a GPU; fp32 for the CPU tests): FP8 experts stay
on the Triton kernels. moe_tuning.prefill_backend measures this path against the Triton tiling per prefill
size and takes the faster, never inside a CUDA graph capture.
"""

from __future__ import annotations

import torch

from common.kernels.elementwise import gated_act
from common.kernels.moe_align import expert_runs


def supported(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Whether the grouped GEMM takes these experts: weights in x's dtype (no FP8), and torch has it."""
    return hasattr(torch, "_grouped_mm") and gate_up.dtype == x.dtype and x.dim() == 2


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T * top_k] int32: flat assignment indices sorted by expert, stable; ends [experts] int32:
    each expert's run's end in that order). Device work only: moe_align's two-kernel sort (torch's sort
    took a prefill layer some twenty launches)."""
    if topk_ids.numel() == 0:
        return (torch.empty(0, dtype=torch.int32, device=topk_ids.device),
                torch.zeros(num_experts, dtype=torch.int32, device=topk_ids.device))
    return expert_runs(topk_ids, num_experts)


def grouped_mm_rows(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """[T * top_k, H]: row t * top_k + k is topk_weights[t, k] * expert topk_ids[t, k]'s SwiGLU MLP of
    x[t] (x [T, H]; gate_up [experts, 2I, H]; down [experts, H, I], in x's dtype)."""
    top_k = topk_ids.shape[1]
    order, ends = sort_by_expert(topk_ids, gate_up.shape[0])
    rows = x.index_select(0, order // top_k)
    h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends)  # [T * top_k, 2I], expert by expert
    y = torch._grouped_mm(gated_act(h, gelu=False), down.transpose(1, 2), offs=ends)
    y.mul_(topk_weights.reshape(-1).index_select(0, order).unsqueeze(1))
    return torch.empty_like(y).index_put_((order,), y)  # back in assignment order
