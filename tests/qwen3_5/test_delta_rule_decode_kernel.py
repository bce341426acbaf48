"""The in-place decode kernel of the gated delta rule (common/kernels/delta_rule_decode.py), run in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host): its outputs and the slots it updates
equal the torch reference's one recurrent step (decoder_svc/model/gated_deltanet.py) in fp32, every other
slot is left as it was, for grouped key heads, rows in any slot order and strided row views. On the GPU:
tests/gpu/test_gated_deltanet_fla_gpu.py runs it through the engine."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from common.kernels.delta_rule_decode import delta_rule_decode_, supports  # noqa: E402
from decoder_svc.model.gated_deltanet import recurrent_gated_delta_rule  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs Triton's interpreter (a CPU host)")

ATOL = 2e-5  # fp32: one step's sums in another order


def _inputs(rows: int, key_heads: int, value_heads: int, dk: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, key_heads, dk, generator=gen)
    k = torch.randn(rows, key_heads, dk, generator=gen)
    v = torch.randn(rows, value_heads, dv, generator=gen)
    g = -torch.rand(rows, value_heads, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(rows, value_heads, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("key_heads,value_heads,dk,dv,slots", [
    (2, 4, 16, 32, [5, 0, 3]),     # grouped key heads, slots out of order
    (4, 4, 32, 64, [1]),            # one row, two value blocks
    (1, 2, 128, 32, [2, 7, 4, 6]),  # Qwen3.5's key dim
])
def test_equals_the_reference_step_and_touches_only_its_slots(key_heads, value_heads, dk, dv, slots):
    rows = len(slots)
    q, k, v, g, beta = _inputs(rows, key_heads, value_heads, dk, dv)
    pool = torch.randn(8, value_heads, dk, dv, generator=torch.Generator().manual_seed(1))
    before = pool.clone()
    index = torch.tensor(slots)
    out = torch.full((rows, value_heads, dv), float("nan"))
    delta_rule_decode_(q, k, v, g, beta, pool, index, dk ** -0.5, out)

    ref_out, ref_state = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                                    beta[:, None], before[index])
    torch.testing.assert_close(out, ref_out[:, 0], atol=ATOL, rtol=0)
    torch.testing.assert_close(pool[index], ref_state, atol=ATOL, rtol=0)
    others = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(pool[others], before[others])


def test_rows_of_a_wider_tensor_and_a_bf16_output():
    """q, k, v as views into one projected row (the decode path's split), out in bf16."""
    rows, heads, dk, dv = 3, 2, 16, 32
    mixed = torch.randn(rows, 2 * heads * dk + heads * dv)
    q = mixed[:, :heads * dk].view(rows, heads, dk)
    k = mixed[:, heads * dk:2 * heads * dk].view(rows, heads, dk)
    v = mixed[:, 2 * heads * dk:].view(rows, heads, dv)
    g, beta = -torch.rand(rows, heads), torch.rand(rows, heads)
    pool = torch.randn(4, heads, dk, dv)
    before, index = pool.clone(), torch.tensor([3, 1, 2])
    out = torch.empty(rows, heads, dv, dtype=torch.bfloat16)
    delta_rule_decode_(q, k, v, g, beta, pool, index, dk ** -0.5, out)
    ref_out, ref_state = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                                    beta[:, None], before[index])
    torch.testing.assert_close(out, ref_out[:, 0].to(torch.bfloat16))
    torch.testing.assert_close(pool[index], ref_state, atol=ATOL, rtol=0)


def test_refuses_what_it_cannot_take():
    assert supports(128, 128) and not supports(72, 128) and not supports(128, 48)
    q, k, v, g, beta = _inputs(1, 1, 1, 24, 32)
    with pytest.raises(ValueError, match="power of two"):
        delta_rule_decode_(q, k, v, g, beta, torch.zeros(1, 1, 24, 32), torch.tensor([0]), 1.0,
                           torch.empty(1, 1, 32))
    q, k, v, g, beta = _inputs(1, 1, 1, 16, 32)
    with pytest.raises(ValueError, match="contiguous fp32"):
        delta_rule_decode_(q, k, v, g, beta, torch.zeros(1, 1, 16, 32, dtype=torch.bfloat16),
                           torch.tensor([0]), 1.0, torch.empty(1, 1, 32))
