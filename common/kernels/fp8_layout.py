"""FP8 (e4m3) weights' scale layout: which weight rows and columns share one scale (quant/fp8.py
describes the layouts; the kernels of fp8_linear.py and fp8_split_k.py take them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


@dataclass(frozen=True)
class ScaleBlock:
    """How many weight rows (bn) and columns (bk) share one scale."""

    rows: int
    cols: int

    def grid(self, n: int, k: int) -> tuple[int, int]:
        """The scale tensor's shape for an [n, k] weight."""
        return -(-n // self.rows), -(-k // self.cols)

    def is_per_channel(self, k: int) -> bool:
        """One scale per output row over all k columns (the product applies it once, at the end)."""
        return self.rows == 1 and self.cols >= k


@torch.no_grad()
def quantize_per_channel(weight: torch.Tensor,
                         reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [N, K], scale fp32 [N, 1]) with q * scale ~= weight; each row's largest magnitude
    maps to 448. A zero row gets scale 1 (q is zero). reduce_amax: the rows' largest magnitudes over the
    whole weight when this is a column slice of it (tensor parallelism), so every slice gets the scales
    of the whole rows."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    if reduce_amax is not None:
        amax = reduce_amax(amax)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], fp32 scales [M, 1]) per row (dynamic, per token), in torch: the math of
    fp8_linear.quantize_rows_fp8 (scale = max(|row|) / FP8_MAX, at least 1e-12; q = clamp(row / scale))."""
    xf = x.float()
    scale = torch.clamp(xf.abs().amax(dim=1, keepdim=True) / FP8_MAX, min=1e-12)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
