"""The one-row fused products (common/kernels/decode_gemv.py) against the ops they replace: the torch
reference's norm / activation followed by the product. On CPU through Triton's interpreter (small
shapes, odd sizes so every mask is used); tests/gpu/test_decode_gemv_gpu.py runs the real shapes."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from common.kernels import decode_gemv as g  # noqa: E402
from decoder_svc.model import kernel_dispatch as d  # noqa: E402
from decoder_svc.model.ops import TorchOps  # noqa: E402
from decoder_svc.model.quant.fp8 import ScaleBlock, per_channel_block, quantize_per_channel  # noqa: E402
from decoder_svc.model.quant.linear import Fp8Linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Several program tiles with ragged last ones: N not a multiple of BLOCK_N, K not of BLOCK_K.
CONFIG = {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 4}
N, K = 38, 75


def _linear(n: int, k: int, bias: bool, dtype: torch.dtype, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return lin.to(DEVICE, dtype)


def _row(k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, k, generator=gen) * 2 + 0.3).to(DEVICE, dtype)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32: sum order only. bf16: the product's output rounding (and the interpreter's bf16 ops).
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_plain_product(dtype, bias):
    lin = _linear(N, K, bias, dtype, 1)
    x = _row(K, dtype, 2)
    out, new_residual = g.fused_gemv(x, d.gemv_weight(lin), config=CONFIG)
    assert new_residual is None and out.shape == (1, N) and out.dtype == dtype
    _close(out, TorchOps.linear(x, lin), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_then_product(dtype, with_residual):
    lin = _linear(N, K, False, dtype, 3)
    x = _row(K, dtype, 4)
    residual = _row(K, dtype, 5) if with_residual else None
    weight = (torch.rand(K, generator=torch.Generator().manual_seed(6)) + 0.5).to(DEVICE, dtype)
    x_before = x.clone()
    res_before = None if residual is None else residual.clone()
    out, new_residual = g.fused_gemv(x, d.gemv_weight(lin), g.RMS_NORM, residual, weight, 1e-6, config=CONFIG)
    want, want_residual = TorchOps.norm_linear(x, res_before, weight, 1e-6, lin)
    _close(out, want, dtype)
    # The new residual stream is exact (one rounding of the sum), and no input was written.
    assert torch.equal(new_residual, want_residual)
    assert torch.equal(x, x_before)
    if residual is not None:
        assert torch.equal(residual, res_before) and new_residual.data_ptr() != residual.data_ptr()
    else:
        assert new_residual is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_then_product(dtype):
    lin = _linear(N, K, True, dtype, 7)
    gate_up = _row(2 * K, dtype, 8)
    out, _ = g.fused_gemv(gate_up, d.gemv_weight(lin), g.SILU_MUL, config=CONFIG)
    _close(out, TorchOps.act_linear(gate_up, lin), dtype)


def test_fp8_weight_per_channel():
    lin = _linear(N, K, True, torch.float32, 9)
    q, scale = quantize_per_channel(lin.weight.detach())
    fp8 = Fp8Linear(K, N, per_channel_block(K), TorchOps, True, torch.float32, DEVICE)
    with torch.no_grad():
        fp8.weight.copy_(q)
        fp8.weight_scale.copy_(scale)
        fp8.bias.copy_(lin.bias)
    x = _row(K, torch.float32, 10)
    w = d.gemv_weight(fp8)
    assert w is not None and w.scale.shape == (N,)
    out, _ = g.fused_gemv(x, w, config=CONFIG)
    _close(out, fp8(x), torch.float32)


def test_refuses_what_it_cannot_run():
    lin = _linear(N, K, False, torch.float32, 11)
    with pytest.raises(ValueError, match="one row"):
        g.fused_gemv(_row(K, torch.float32, 1).expand(2, K), d.gemv_weight(lin), config=CONFIG)
    with pytest.raises(ValueError, match="one row"):
        g.fused_gemv(_row(K, torch.float32, 1), d.gemv_weight(lin), g.SILU_MUL, config=CONFIG)
    blocked = Fp8Linear(256, 256, ScaleBlock(128, 128), TorchOps, False, torch.float32, DEVICE)
    assert d.gemv_weight(blocked) is None  # block-scaled FP8 keeps its own kernels


def test_choices_follow_the_mode_and_the_timings():
    key = d.GemvKey(8, 8, torch.bfloat16, False, g.PLAIN, False)
    assert d.GemvChoices("on").use_fused(key) and not d.GemvChoices("off").use_fused(key)
    auto = d.GemvChoices("auto")
    assert not auto.use_fused(key)  # unmeasured: the separate path
    auto.timings[key] = d.GemvTiming(key, fused_us=5.0, unfused_us=7.0)
    assert auto.use_fused(key)
    auto.timings[key] = d.GemvTiming(key, fused_us=9.0, unfused_us=7.0)
    assert not auto.use_fused(key)
    with pytest.raises(ValueError, match="MMSERVE_DECODE_GEMV"):
        d.GemvChoices("sometimes")
