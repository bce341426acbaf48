"""Fp8Linear: a linear layer whose weight is FP8 with fp32 scales (decoder_svc.model.quant.fp8).

The product goes through the model's ops: the torch reference dequantizes and multiplies (CPU, tests);
the Triton ops run a weight-only FP8 kernel for small batches and an FP8 tensor-core product for large
ones (common/kernels/fp8_linear.py).
"""

from __future__ import annotations

import torch
from torch import nn

from decoder_svc.model.ops import TorchOps
from decoder_svc.model.quant.fp8 import FP8_DTYPE, ScaleBlock


class Fp8Linear(nn.Module):
    """y = x @ (weight * scale)^T + bias, weight float8_e4m3fn [out, in], scale fp32 by `block`."""

    def __init__(self, in_features: int, out_features: int, block: ScaleBlock, ops: type[TorchOps],
                 bias: bool, bias_dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block, self.ops = in_features, out_features, block, ops
        grid = block.grid(out_features, in_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(grid, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device),
                                  requires_grad=False) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.fp8_linear(x, self.weight, self.weight_scale, self.block, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"scale_block=({self.block.rows}, {self.block.cols}), bias={self.bias is not None}")


# The decoder layers' projections that FP8 replaces; embeddings, norms and the lm_head stay in the model
# dtype (the head is a small share of the bytes and the most sensitive to rounding).
QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def swap_in_fp8(model: nn.Module, blocks: dict[str, ScaleBlock], ops: type[TorchOps]) -> None:
    """Replace each nn.Linear named in `blocks` (module name -> scale block) by an empty Fp8Linear on the
    same device; the caller then loads the FP8 weights and scales into them."""
    for name, block in blocks.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        setattr(parent, child, Fp8Linear(old.in_features, old.out_features, block, ops, old.bias is not None,
                                         old.weight.dtype, old.weight.device))
