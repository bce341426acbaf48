"""The per-token FP8 quantization kernel (fp8_linear.quantize_rows_fp8, what scaled_mm_fp8 feeds the
tensor cores) against torch's five-op reference. On CPU through Triton's interpreter (tests/conftest.py);
tests/gpu/test_fp8_gpu.py runs the FP8 products that use it on the real shapes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from common.kernels import fp8_linear as t  # noqa: E402
from decoder_svc.model.quant.fp8 import FP8_DTYPE, FP8_MAX  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@pytest.mark.parametrize("m,k", [(1, 7), (3, 1024), (5, 1500), (2, 3000)])
def test_rows_quantized_as_torch_does(m: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-1, 2, m).unsqueeze(1)).to(torch.float16)
    if m > 1:
        x[-1, k // 2] = 900.0  # a row whose maximum stands far from the rest
    q, scale = t.quantize_rows_fp8(x.to(DEVICE))
    ref_q, ref_scale = _reference(x)
    assert q.dtype == FP8_DTYPE and q.shape == (m, k) and scale.shape == (m, 1)
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=0, atol=0)
    # The same fp32 quotient, cast to e4m3. Triton's interpreter casts with numpy, which the GPU's
    # conversion does not: a rounding that carries into the next power of two goes wrong (125.8 -> 64,
    # not 128), ties round away from zero (84 -> 88, not 80), subnormals differ. On CPU those are left
    # out or allowed one step; on CUDA every value must be equal.
    got, want = q.cpu().float(), ref_q.float()
    assert got.abs().amax(dim=1).eq(FP8_MAX).all()  # each row's maximum maps to the format's largest
    if DEVICE == "cuda":
        assert torch.equal(got, want)
        return
    mantissa, _ = torch.frexp(want)
    checked = (want.abs() >= 2.0**-6) & (mantissa.abs() != 0.5)
    assert checked.float().mean() > 0.8
    got, want = got[checked], want[checked]
    assert ((got - want).abs() <= want.abs() * 2.0**-3).all()
    assert (got == want).float().mean() > 0.99


def test_a_zero_row_keeps_a_positive_scale() -> None:
    q, scale = t.quantize_rows_fp8(torch.zeros(2, 64, dtype=torch.float16, device=DEVICE))
    assert (scale.cpu() == 1e-12).all() and (q.cpu().float() == 0).all()


def test_no_rows() -> None:
    q, scale = t.quantize_rows_fp8(torch.zeros(0, 64, dtype=torch.float16, device=DEVICE))
    assert q.shape == (0, 64) and scale.shape == (0, 1)
