"""An FP8 vision tower (`--vision-quantization fp8`): its linear layers with FP8 (e4m3) weights, one scale
per output channel, quantized once at load, and activations quantized per token on the fly.

On a GPU each product is FP8 x FP8 on the tensor cores (`torch._scaled_mm` with per-row and per-column
scales: common/kernels/fp8_linear.scaled_mm_fp8), twice the bf16 rate on Hopper; the activations' scales
cost one pass over them. Elsewhere the same quantization of weights and activations runs in torch with
fp32 products (the reference the GPU tests compare the kernel with).

Which layers: every nn.Linear of the tower but the patch embedding (its input is pixels, and it is a
small share of the work) whose widths are multiples of 16 (what the FP8 products take); the others keep
the tower's dtype. Norms, attention and the rotary stay in the tower's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from common.kernels.fp8_layout import quantize_per_channel, quantize_rows_reference

FP8_WIDTH_MULTIPLE = 16  # in and out features of a quantized layer (the FP8 products' alignment)
_KEPT = ("patch_embed",)  # module-name prefixes left in the tower's dtype


class Fp8VisionLinear(nn.Module):
    """y = x @ (q * scale)^T + bias with x quantized per token; made from an nn.Linear (`from_linear`)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # float8_e4m3fn [out, in]
        self.register_buffer("weight_scale", scale)  # fp32 [out, 1]
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8VisionLinear:
        q, scale = quantize_per_channel(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1 or rows.stride(0) != self.in_features:
            rows = rows.contiguous()
        if rows.is_cuda:
            from common.kernels.fp8_linear import scaled_mm_fp8

            out = scaled_mm_fp8(rows, self.weight, self.weight_scale, self.bias)
        else:
            out = fp8_linear_reference(rows, self.weight, self.weight_scale, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 per channel"


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """The FP8 product's math in torch: x [M, K] quantized per row, times the dequantized weight, in fp32;
    returned in x's dtype."""
    xq, x_scale = quantize_rows_reference(x)
    out = (xq.float() * x_scale) @ (weight.float() * scale.float()).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def quantizable(name: str, module: nn.Module) -> bool:
    """Whether `quantize_tower` replaces this module (named as in tower.named_modules())."""
    if not isinstance(module, nn.Linear) or name.startswith(_KEPT):
        return False
    return module.in_features % FP8_WIDTH_MULTIPLE == 0 and module.out_features % FP8_WIDTH_MULTIPLE == 0


@torch.no_grad()
def quantize_tower(tower: nn.Module) -> list[str]:
    """Replace every quantizable linear layer of `tower` by an Fp8VisionLinear, in place; the names
    replaced, in order. A tower with none to replace is an error (nothing would change)."""
    names = [name for name, module in tower.named_modules() if quantizable(name, module)]
    if not names:
        raise ValueError("the vision tower has no linear layer an FP8 product can take")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = tower.get_submodule(parent_name) if parent_name else tower
        setattr(parent, child, Fp8VisionLinear.from_linear(getattr(parent, child)))
    return names

