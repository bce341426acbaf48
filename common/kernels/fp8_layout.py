"""FP8 (e4m3) weights' scale layout: which weight rows and columns share one scale (quant/fp8.py
describes the layouts; the kernels of fp8_linear.py and fp8_split_k.py take them)."""

from __future__ import annotations

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
