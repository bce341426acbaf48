"""FP8 (e4m3) weights: the scale layout, quantizing a weight and dequantizing one (the reference math).

A quantized weight is `q` float8_e4m3fn [N, K] (N output rows) with fp32 scales `scale` [ceil(N / bn),
ceil(K / bk)]: the weight is q * scale of its (row // bn, column // bk) block. Every published layout is
one of these:

- per output channel (bn = 1, bk = K): what `--quantization fp8` makes at load and compressed-tensors'
  "channel" strategy;
- per tensor (bn = N, bk = K): compressed-tensors' "tensor" strategy (stored here per channel, which is
  the same numbers, so that q/k/v shards with different scales can share one fused matrix);
- blocks (bn = bk = 128 usually): HF's fine-grained FP8 and compressed-tensors' "block" strategy.
"""

from __future__ import annotations

import torch

# The layout the kernels take lives with them (common/kernels); the model reaches it through here.
from common.kernels.fp8_layout import FP8_DTYPE, FP8_MAX, ScaleBlock, quantize_per_channel

__all__ = ["FP8_DTYPE", "FP8_MAX", "ScaleBlock", "dequantize", "expand_scale", "per_channel_block",
           "quantize_per_channel", "rows_to_channels"]


def per_channel_block(k: int) -> ScaleBlock:
    """The per-output-channel layout for a weight with k input columns."""
    return ScaleBlock(1, k)


def expand_scale(scale: torch.Tensor, block: ScaleBlock, n: int, k: int) -> torch.Tensor:
    """fp32 [n, k]: every weight element's scale."""
    full = scale.float().repeat_interleave(block.rows, dim=0)[:n]
    return full.repeat_interleave(block.cols, dim=1)[:, :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight q * scale in `dtype`, computed in fp32 and rounded once (the CPU reference path and the
    'dequantized twin' the tests compare FP8 checkpoints with)."""
    n, k = q.shape
    if block.is_per_channel(k):
        return (q.float() * scale.float().view(n, 1)).to(dtype)
    return (q.float() * expand_scale(scale, block, n, k)).to(dtype)


def rows_to_channels(scale: torch.Tensor, block: ScaleBlock, n: int) -> torch.Tensor:
    """Scales with one row per weight row (bn = 1): lets shards of different layouts be concatenated."""
    return scale.float().repeat_interleave(block.rows, dim=0)[:n]
