"""The Gated DeltaNet layer's small Triton kernels (common/kernels/elementwise.py), run in Triton's
interpreter on a CPU host: gated_rms_norm equals the layer's torch GatedRMSNorm
(decoder_svc/model/gated_deltanet.py, HF's Qwen3NextRMSNormGated) on rows of one head each, for strided
rows, a row count that is not a multiple of the kernel's row block, and a head dim that is not a power of
two; delta_gates equals the layer's `_gates` (beta and the log decay)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from common.kernels.elementwise import delta_gates, gated_rms_norm  # noqa: E402
from decoder_svc.model.gated_deltanet import GatedDeltaNet, GatedRMSNorm  # noqa: E402
from tests.qwen3_5.linear_steps import text_shape  # noqa: E402

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 70])
def test_delta_gates_equal_the_layer_s(dtype, rows):
    layer = GatedDeltaNet(text_shape())
    heads = layer.shape.num_v_heads
    gen = torch.Generator().manual_seed(rows)
    with torch.no_grad():
        layer.A_log.copy_(torch.randn(heads, generator=gen))
        layer.dt_bias.copy_(torch.randn(heads, generator=gen))
    wide = (torch.randn(rows, 2 * heads + 3, generator=gen) * 8).to(dtype)
    a, b = wide[:, :heads], wide[:, heads + 3:]  # strided rows, as slices of a wider projection
    a[0, 0] = 30.0  # past softplus's threshold
    beta, g = delta_gates(a, b, layer.A_log.to(dtype), layer.dt_bias.to(dtype))
    with torch.no_grad():
        ref_beta, ref_g = layer.to(dtype)._gates(b, a)
    assert beta.dtype == dtype and g.dtype == torch.float32
    torch.testing.assert_close(beta, ref_beta, atol=1e-6 if dtype == torch.float32 else 4e-3, rtol=0)
    torch.testing.assert_close(g, ref_g, atol=1e-5, rtol=1e-5)
