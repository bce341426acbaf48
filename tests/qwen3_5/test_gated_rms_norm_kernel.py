"""The Gated DeltaNet layer's output norm as one Triton kernel (common/kernels/elementwise.py's
gated_rms_norm), run in Triton's interpreter on a CPU host: it equals the layer's torch GatedRMSNorm
(decoder_svc/model/gated_deltanet.py, HF's Qwen3NextRMSNormGated) on rows of one head each, for strided
rows, a row count that is not a multiple of the kernel's row block, and a head dim that is not a power of
two."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from common.kernels.elementwise import gated_rms_norm  # noqa: E402
from decoder_svc.model.gated_deltanet import GatedRMSNorm  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs Triton's interpreter (a CPU host)")


def _reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = GatedRMSNorm(x.shape[1], eps).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x, gate)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("rows, dim", [(37, 32), (5, 24), (64, 128)])
def test_equals_the_layer_s_torch_norm(dtype, atol, rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    gate = torch.randn(rows, dim, generator=gen).to(dtype)
    weight = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    out = gated_rms_norm(x, gate, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), _reference(x, gate, weight, 1e-6).float(), atol=atol, rtol=0)
    # a mutant without the gate is far from it (the test tells the gate's part)
    ungated = _reference(x, torch.full_like(gate, 30.0), weight, 1e-6)
    assert (out.float() - ungated.float()).abs().max() > 0.1


def test_strided_rows():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(20, 80, generator=gen)
    x, gate = wide[:, :32], wide[:, 40:72]  # row stride 80
    weight = torch.rand(32, generator=gen) + 0.5
    torch.testing.assert_close(gated_rms_norm(x, gate, weight, 1e-6), _reference(x, gate, weight, 1e-6),
                               atol=1e-5, rtol=0)


def test_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="gate must be"):
        gated_rms_norm(torch.ones(4, 8), torch.ones(4, 7), torch.ones(8), 1e-6)
