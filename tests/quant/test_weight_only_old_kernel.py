"""The tensor-core weight-only FP8 kernel for more than 64 rows and block scales the split-K kernel does
not take, under Triton's interpreter (fp16 activations: the interpreter's bf16 dot is not faithful),
against the dequantize-then-product reference. It shares its K loop with the split-K kernel."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from common.kernels import fp8_linear as t  # noqa: E402
from decoder_svc.model.quant.fp8 import ScaleBlock, dequantize, per_channel_block, quantize_per_channel  # noqa: E402


@pytest.mark.parametrize("m, n, k, block", [(70, 40, 96, None), (5, 48, 128, (16, 32))])
def test_old_path_matches_the_reference(m, n, k, block):
    torch.manual_seed(m)
    weight = torch.randn(n, k) / k ** 0.5
    if block is None:
        q, scale = quantize_per_channel(weight)
        sb = per_channel_block(k)
    else:
        sb = ScaleBlock(*block)
        rows, cols = sb.grid(n, k)
        scale = torch.rand(rows, cols) * 0.01 + 0.005
        q = (weight / scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
             ).clamp(-448, 448).to(torch.float8_e4m3fn)
    x = torch.randn(m, k).half()
    out = torch.empty(m, n, dtype=x.dtype)
    block_m, block_n, block_k = 16, 16, 32  # the autotuner's timing needs a GPU: one config, fixed
    grid = (-(-n // block_n), -(-m // block_m))
    t._weight_only_kernel[grid](x, q, scale, x, out, m, n, k, x.stride(0), q.stride(0), scale.stride(0),
                                scale.stride(1) if scale.dim() == 2 else 0, out.stride(0),
                                SCALE_ROWS=sb.rows, SCALE_COLS=sb.cols, PER_CHANNEL=sb.is_per_channel(k),
                                HAS_BIAS=False, M_BUCKET=16, BLOCK_M=block_m, BLOCK_N=block_n,
                                BLOCK_K=block_k)
    ref = x.float() @ dequantize(q, scale, sb).t()
    assert (out.float() - ref).abs().max() <= 2e-3 * ref.abs().max()
