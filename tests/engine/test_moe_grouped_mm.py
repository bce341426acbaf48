"""The prefill path of a MoE layer through torch's grouped GEMM (common/kernels/moe_grouped_mm.py) against the
torch reference (decoder_svc/model/moe.py's experts_reference), on CPU in fp32 (torch's own loop of products
stands in for CUTLASS's kernels; the SiLU and the combine in Triton's interpreter), and the choice between it
and the Triton tiling (moe_tuning.prefill_backend). tests/gpu/test_fused_moe_gpu.py runs it in bf16."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")
if not hasattr(torch, "_grouped_mm"):
    pytest.skip("this torch has no grouped GEMM", allow_module_level=True)

from common.kernels import moe_tuning as tuning  # noqa: E402
from common.kernels.fused_moe import combine  # noqa: E402
from common.kernels.moe_grouped_mm import grouped_mm_rows, sort_by_expert, supported  # noqa: E402
from decoder_svc.model.moe import experts_reference, route  # noqa: E402
from tests.engine.test_fused_moe import DEVICE, HIDDEN, _experts  # noqa: E402  (the same tiny experts)


def _grouped(x, gate_up, down, weights, ids) -> torch.Tensor:
    return combine(grouped_mm_rows(x, gate_up, down, weights, ids), *ids.shape)


def test_the_sort_groups_assignments_by_expert_in_flat_order():
    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [1, 3]], device=DEVICE)  # experts 2 and 4 empty
    order, ends = sort_by_expert(ids, num_experts=5)
    assert order.tolist() == [1, 5, 3, 6, 0, 2, 4, 7]  # expert 0, 1, then 3, each in flat order
    assert ends.dtype == torch.int32 and ends.tolist() == [2, 4, 4, 8, 8]


@pytest.mark.parametrize("tokens, num_experts, top_k", [(1, 8, 2), (37, 4, 2), (70, 12, 3), (19, 16, 4)])
def test_matches_the_reference_with_ragged_and_empty_experts(tokens, num_experts, top_k):
    gen = torch.Generator().manual_seed(tokens * 7 + num_experts)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE)
    router = torch.randn(num_experts, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = route(x @ router.t(), top_k, renormalize=True)
    gate_up, down = _experts(num_experts, seed=tokens)
    out = _grouped(x, gate_up, down, weights, ids)
    ref = experts_reference(x, weights, ids, gate_up, down)
    assert out.shape == ref.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # the same products, summed in another order


def test_all_tokens_on_one_expert_and_int32_ids():
    x = torch.randn(21, HIDDEN, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ids = torch.tensor([[2, 5]] * 21, dtype=torch.int32, device=DEVICE)  # route_topk's ids are int32
    weights = torch.full((21, 2), 0.5, device=DEVICE)
    gate_up, down = _experts(8, seed=2)
    torch.testing.assert_close(_grouped(x, gate_up, down, weights, ids),
                               experts_reference(x, weights, ids.long(), gate_up, down), rtol=1e-5, atol=1e-5)


def test_fp8_experts_are_not_taken():
    x = torch.randn(4, HIDDEN).to(DEVICE)
    gate_up, _ = _experts(4, seed=3)
    assert supported(x, gate_up)
    assert not supported(x.bfloat16(), gate_up.to(torch.float8_e4m3fn))


def test_decode_sizes_and_cpu_tensors_take_the_triton_tiling(monkeypatch):
    gate_up, down = _experts(4, seed=4)
    small = torch.randn(tuning.TUNED_TOKENS, HIDDEN).to(DEVICE)
    assert tuning.prefill_backend(small, gate_up, down, 2) == "triton"
    if DEVICE == "cpu":
        monkeypatch.setenv(tuning.PREFILL_ENV, "grouped_mm")
        big = torch.randn(tuning.TUNED_TOKENS + 1, HIDDEN)
        assert tuning.prefill_backend(big, gate_up, down, 2) == "triton"  # a GPU path only
    assert tuning.PREFILL_CHOICES == {}  # nothing measured


def test_an_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv(tuning.PREFILL_ENV, "cutlass")
    gate_up, down = _experts(4, seed=5)
    with pytest.raises(ValueError, match="MMSERVE_MOE_PREFILL='cutlass'"):
        tuning.prefill_backend(torch.randn(80, HIDDEN).to(DEVICE), gate_up, down, 2)
