"""The fused MoE kernels (common/kernels/fused_moe.py) against the torch reference (decoder_svc/model/moe.py's
experts_reference) and against their own contract (the block-aligned sort). On CPU through Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 and patches its scalar conversion), in fp32 (the
interpreter's bf16 tl.dot is wrong), tiny shapes with ragged sizes: tokens per expert ragged, experts
with no token, top-k ties. tests/gpu/test_fused_moe_gpu.py runs bf16 on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from common.kernels import moe_align  # noqa: E402
from common.kernels.fused_moe import GemmConfig  # noqa: E402
from common.kernels.moe_align import (  # noqa: E402
    align_to_blocks,
    align_to_blocks_chunked,
    align_to_blocks_torch,
    padded_rows,
)
from common.kernels.moe_gemv import GemvConfig, gemv_moe, routed_gemv_moe  # noqa: E402
from common.kernels.moe_route import route_topk  # noqa: E402
from common.kernels.moe_tuning import config_name, run_experts  # noqa: E402
from decoder_svc.model.moe import experts_reference, route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Blocks of 16 rows (tl.dot's smallest), N and K tiles of 16: hidden 40 and width 24 leave ragged tiles.
SMALL = GemmConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
HIDDEN, WIDTH = 40, 24
# Every path a batch may take (moe_tuning.choose_config): the sort and grouped GEMM (either operand order),
# the per-assignment
# GEMVs with the separate combine and with the combine in the down product (K tiles of 16 leave ragged ones).
PATHS = (SMALL, GemmConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1, swap_ab=True),
         GemvConfig(block_n=16, block_k=16, num_warps=4),
         GemvConfig(block_n=8, block_k=16, num_warps=2, fuse_combine=True))


def _experts(num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * WIDTH, HIDDEN, generator=gen) / HIDDEN**0.5
    down = torch.randn(num_experts, HIDDEN, WIDTH, generator=gen) / WIDTH**0.5
    return gate_up.to(DEVICE), down.to(DEVICE)


def _check(x, gate_up, down, weights, ids) -> None:
    ref = experts_reference(x, weights, ids, gate_up, down)
    for config in PATHS:
        out = run_experts(x, gate_up, down, weights, ids, config)
        assert out.shape == ref.shape and out.dtype == x.dtype, config_name(config)
        # fp32 products summed in another order: a few ulps of the outputs' scale
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=config_name(config))


@pytest.mark.parametrize("align", [align_to_blocks, align_to_blocks_chunked, align_to_blocks_torch],
                         ids=["kernel", "chunked", "torch"])
def test_alignment_groups_every_assignment_once_in_its_experts_blocks(align):
    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [1, 3], [3, 2]], device=DEVICE)  # expert 4, 5 empty
    a = align(ids, num_experts=6, block_m=4)
    rows, experts = a.sorted_rows.cpu(), a.block_expert.cpu()
    n = ids.numel()
    assert rows.numel() == padded_rows(n, 6, 4) and rows.numel() % 4 == 0
    real = rows[rows < n]
    assert sorted(real.tolist()) == list(range(n))  # each assignment once, the rest padding
    flat = ids.reshape(-1).cpu()
    for block, expert in enumerate(experts.tolist()):
        members = rows[block * 4:(block + 1) * 4]
        members = members[members < n]
        if expert < 0:
            assert members.numel() == 0
        else:
            assert (flat[members] == expert).all() and members.numel() > 0
            assert members.tolist() == sorted(members.tolist())  # flat order within an expert
    # expert 3 has 5 rows: two blocks; experts 0, 1, 2 one each; 4 and 5 none; the rest unused (-1)
    assert experts.tolist()[:5] == [0, 1, 2, 3, 3] and set(experts.tolist()[5:]) == {-1}


@pytest.mark.parametrize("tokens, num_experts, top_k, block_m",
                         [(1, 8, 2, 16), (5, 6, 3, 4), (37, 4, 2, 16), (19, 16, 4, 8), (70, 12, 3, 16),
                          (3, 128, 8, 16), (32, 128, 8, 16)])
def test_the_alignment_kernel_equals_the_torch_sort(tokens, num_experts, top_k, block_m):
    """Programs of 64 assignments: 210 of them span four programs (each counts the earlier ones); 128
    experts (the 30B-A3B's) with 24 assignments leave most empty; 32 streams at top-8 (256 assignments,
    the kernel's largest); expert counts not a power of two."""
    gen = torch.Generator().manual_seed(tokens + num_experts)
    ids = torch.rand(tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices.to(DEVICE)
    kernel = align_to_blocks(ids, num_experts, block_m)
    reference = align_to_blocks_torch(ids, num_experts, block_m)
    assert torch.equal(kernel.sorted_rows, reference.sorted_rows)
    assert torch.equal(kernel.block_expert, reference.block_expert)


def test_large_batches_take_the_chunked_sort(monkeypatch):
    monkeypatch.setattr(moe_align, "ALIGN_KERNEL_MAX", 4)
    ids = torch.tensor([[1, 0], [0, 2], [2, 1]], device=DEVICE)
    monkeypatch.setattr(moe_align, "_align_kernel", None)  # would fail if launched
    a = align_to_blocks(ids, 3, 16)
    # expert 0 holds assignments 1 and 2 (flat t * top_k + k), then padding; one block per expert
    assert a.sorted_rows[:3].tolist() == [1, 2, 6] and a.block_expert.tolist()[:3] == [0, 1, 2]


@pytest.mark.parametrize("tokens, num_experts, top_k, block_m, chunk, pad_rows",
                         [(40, 6, 3, 16, 64, 512), (37, 4, 2, 16, 64, 64), (200, 16, 4, 8, 128, 512),
                          (70, 128, 8, 16, 256, 512), (70, 128, 8, 16, 256, 128), (1, 8, 2, 16, 64, 64)])
def test_the_chunked_sort_equals_the_torch_sort(tokens, num_experts, top_k, block_m, chunk, pad_rows,
                                                 monkeypatch):
    """Chunks of 64 to 256 assignments (the last one ragged), the counts read back in pieces of 2 chunks:
    an expert's run spans chunks and its assignments keep their flat order across them; 128 experts with
    most empty; one token (a single ragged chunk); and (pad_rows small) more placement programs than
    chunks, those past the last chunk writing padding rows only."""
    monkeypatch.setattr(moe_align, "SORT_CHUNK", chunk)
    monkeypatch.setattr(moe_align, "COUNT_ROWS", 2)
    monkeypatch.setattr(moe_align, "PAD_ROWS_PER_PROGRAM", pad_rows)
    gen = torch.Generator().manual_seed(tokens * 7 + num_experts)
    ids = torch.rand(tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices.to(DEVICE)
    chunked = align_to_blocks_chunked(ids, num_experts, block_m)
    reference = align_to_blocks_torch(ids, num_experts, block_m)
    assert torch.equal(chunked.sorted_rows, reference.sorted_rows)
    assert torch.equal(chunked.block_expert, reference.block_expert)


@pytest.mark.parametrize("tokens, num_experts, top_k", [(1, 8, 2), (5, 6, 3), (37, 4, 2), (19, 16, 4)])
def test_matches_reference_with_ragged_and_empty_experts(tokens, num_experts, top_k):
    """Router-chosen experts: at 1 token most experts are empty; at 37 tokens over 4 experts each expert's
    run spans several 16-row blocks with a ragged last one."""
    gen = torch.Generator().manual_seed(tokens * 31 + num_experts)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE)
    router = torch.randn(num_experts, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = route(x @ router.t(), top_k, renormalize=True)
    gate_up, down = _experts(num_experts, seed=tokens)
    _check(x, gate_up, down, weights, ids)


def test_all_tokens_on_one_expert_and_the_others_empty():
    x = torch.randn(21, HIDDEN, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ids = torch.tensor([[2, 5]] * 21, device=DEVICE)
    weights = torch.full((21, 2), 0.5, device=DEVICE)
    gate_up, down = _experts(8, seed=2)
    _check(x, gate_up, down, weights, ids)


def test_top_k_ties_route_as_torch_topk_and_compute_alike():
    """Equal router logits: torch.topk's choice among ties is the routing (both paths take it), and the
    renormalised weights are equal."""
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits = torch.zeros(6, 8, device=DEVICE)
    logits[:, 5] = 1.0  # one clear winner, then a seven-way tie for the second and third
    weights, ids = route(logits, 3, renormalize=True)
    assert (ids[:, 0] == 5).all() and torch.allclose(weights[:, 1], weights[:, 2])
    assert torch.allclose(weights.sum(-1), torch.ones(6, device=DEVICE))
    gate_up, down = _experts(8, seed=4)
    _check(x, gate_up, down, weights, ids)


def test_no_tokens():
    gate_up, down = _experts(4, seed=5)
    x = torch.empty(0, HIDDEN, device=DEVICE)
    for config in PATHS:
        out = run_experts(x, gate_up, down, torch.empty(0, 2, device=DEVICE),
                          torch.empty(0, 2, dtype=torch.int64, device=DEVICE), config)
        assert out.shape == (0, HIDDEN)


def _fp8_experts(num_experts: int, seed: int):
    """(gate_up, gate_up scales, down, down scales): the experts quantized per expert and output channel,
    as `--quantization fp8` does at load (decoder_svc/model/quant/experts.py)."""
    from decoder_svc.model.quant.experts import quantize_experts

    gate_up, down = _experts(num_experts, seed)
    state = {"layers.0.mlp.experts.gate_up_proj": gate_up, "layers.0.mlp.experts.down_proj": down}
    assert quantize_experts(state, DEVICE) == ["layers.0.mlp.experts"]
    return tuple(state[f"layers.0.mlp.experts.{n}"] for n in ("gate_up_proj", "gate_up_proj_scale",
                                                               "down_proj", "down_proj_scale"))


def _check_fp8(x, weights, ids, num_experts: int, seed: int) -> None:
    gate_up, gate_up_scale, down, down_scale = _fp8_experts(num_experts, seed)
    assert gate_up.dtype == torch.float8_e4m3fn and gate_up_scale.shape == (num_experts, 2 * WIDTH, 1)
    ref = experts_reference(x, weights, ids, gate_up, down, gate_up_scale, down_scale)
    for config in PATHS:
        out = run_experts(x, gate_up, down, weights, ids, config, gate_up_scale, down_scale)
        assert out.shape == ref.shape and out.dtype == x.dtype, config_name(config)
        # the kernel scales the fp32 sum once per column, the reference each weight before the sum: fp32 ulps
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=config_name(config))
    # and the FP8 experts are the model's experts to FP8's precision (not a different function)
    full = experts_reference(x, weights, ids, *_experts(num_experts, seed))
    assert ((ref - full).norm() / full.norm()).item() < 0.1


@pytest.mark.parametrize("tokens, num_experts, top_k", [(1, 8, 2), (5, 6, 3), (37, 4, 2), (19, 16, 4)])
def test_fp8_experts_match_the_dequantized_reference(tokens, num_experts, top_k):
    """FP8 weights widened in the kernel, per-channel scales on the accumulator: ragged runs, empty
    experts (one token over 8 experts leaves 6 empty), several blocks per expert."""
    gen = torch.Generator().manual_seed(tokens * 17 + num_experts)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE)
    router = torch.randn(num_experts, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = route(x @ router.t(), top_k, renormalize=True)
    _check_fp8(x, weights, ids, num_experts, seed=tokens + 1)


def test_fp8_experts_with_all_tokens_on_one_expert_and_ties():
    x = torch.randn(21, HIDDEN, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    _check_fp8(x, torch.full((21, 2), 0.5, device=DEVICE), torch.tensor([[2, 5]] * 21, device=DEVICE), 8, 7)
    logits = torch.zeros(21, 8, device=DEVICE)
    logits[:, 1] = 1.0  # a seven-way tie for the second and third places
    weights, ids = route(logits, 3, renormalize=True)
    _check_fp8(x, weights, ids, 8, 8)


def test_fp8_scales_must_fit_the_experts():
    gate_up, gate_up_scale, down, down_scale = _fp8_experts(4, 9)
    x = torch.randn(2, HIDDEN, device=DEVICE)
    ids = torch.tensor([[0, 1], [2, 3]], device=DEVICE)
    for config in PATHS:
        with pytest.raises(ValueError, match="do not fit"):
            run_experts(x, gate_up, down, torch.full((2, 2), 0.5, device=DEVICE), ids, config,
                        gate_up_scale=down_scale, down_scale=gate_up_scale)


def test_the_gemvs_combine_in_the_down_product_as_the_separate_combine_does():
    """Slot order and one rounding per slot either way: the same bits."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = route(torch.randn(3, 8, generator=gen).to(DEVICE), 4, renormalize=False)
    gate_up, down = _experts(8, seed=13)
    separate = gemv_moe(x, gate_up, down, weights, ids, GemvConfig(block_n=8, block_k=16, num_warps=2))
    fused = gemv_moe(x, gate_up, down, weights, ids,
                     GemvConfig(block_n=8, block_k=16, num_warps=2, fuse_combine=True))
    assert torch.equal(separate, fused)


@pytest.mark.parametrize("tokens, num_experts, top_k, renormalize",
                         [(1, 128, 8, True), (5, 6, 3, True), (40, 16, 4, False), (17, 8, 1, True),
                          (33, 128, 8, True)])
def test_the_router_kernel_equals_route(tokens, num_experts, top_k, renormalize):
    """Tokens over several programs of 16, expert counts and top_k not powers of two: the same experts in
    the same (descending) order, the same weights to fp32's last bits."""
    gen = torch.Generator().manual_seed(tokens * 7 + num_experts)
    logits = (torch.randn(tokens, num_experts, generator=gen) * 3).to(DEVICE)
    weights, ids = route_topk(logits, top_k, renormalize)
    ref_weights, ref_ids = route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == logits.dtype
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)


def test_the_router_kernel_takes_the_lowest_expert_among_ties():
    logits = torch.zeros(3, 8, device=DEVICE)
    logits[:, 6] = 2.0
    logits[1, 2] = logits[1, 5] = 1.0
    weights, ids = route_topk(logits, 3, renormalize=True)
    assert ids.tolist() == [[6, 0, 1], [6, 2, 5], [6, 0, 1]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, device=DEVICE))
    # and the experts computed from its choice are route's experts computed from the same choice
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    gate_up, down = _experts(8, seed=9)
    _check(x, gate_up, down, weights, ids)


def test_the_router_kernel_refuses_what_it_cannot_route():
    with pytest.raises(ValueError, match="top_k 9 of 8"):
        route_topk(torch.zeros(2, 8, device=DEVICE), 9, True)
    with pytest.raises(ValueError, match="contiguous rows"):
        route_topk(torch.zeros(8, 2, device=DEVICE).t(), 1, True)
    weights, ids = route_topk(torch.zeros(0, 8, device=DEVICE), 2, True)
    assert weights.shape == ids.shape == (0, 2)


def test_the_down_product_refuses_rows_that_are_not_gate_and_up_halves():
    from common.kernels.fused_moe import grouped_gemm

    _, down = _experts(4, seed=10)
    ids = torch.tensor([[0, 1]], device=DEVICE)
    alignment = align_to_blocks(ids, 4, SMALL.block_m)
    with pytest.raises(ValueError, match="swiglu=True"):
        grouped_gemm(torch.zeros(2, WIDTH, device=DEVICE), down, alignment, 2, 2, False, SMALL, swiglu=True)


@pytest.mark.parametrize("tokens, num_experts, top_k", [(1, 8, 2), (70, 12, 3), (300, 16, 4)])
def test_the_expert_runs_equal_torchs_stable_sort(tokens, num_experts, top_k):
    """The grouped-GEMM path's sort (the two-kernel sort with one-row blocks) against torch's."""
    gen = torch.Generator().manual_seed(tokens)
    # the last expert left empty
    ids = torch.randint(0, num_experts - 1, (tokens, top_k), generator=gen).to(DEVICE)
    order, ends = moe_align.expert_runs(ids, num_experts)
    ref_order, counts = moe_align.expert_order(ids.reshape(-1).long(), num_experts)
    assert order.dtype == torch.int32 and torch.equal(order.long(), ref_order)
    assert ends.dtype == torch.int32 and torch.equal(ends.long(), counts.cumsum(0))


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("fuse_combine", [False, True])
def test_the_gemvs_that_route_themselves_equal_the_router_kernel_then_the_gemvs(renormalize, fuse_combine):
    """routed_gemv_moe makes route_topk's choice inside the gate/up programs: the same bits as the router
    kernel followed by gemv_moe, ties (equal logits) included, and the reference's values."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(5, HIDDEN, generator=gen).to(DEVICE)
    logits = torch.randn(5, 12, generator=gen).to(DEVICE)
    logits[3] = 0.5  # a twelve-way tie: the lowest experts first
    logits[4, 7:] = 2.0  # a five-way tie for the top three
    gate_up, down = _experts(12, seed=22)
    config = GemvConfig(block_n=16, block_k=16, num_warps=4, fuse_combine=fuse_combine)
    routed = routed_gemv_moe(x, logits, 3, renormalize, gate_up, down, config)
    weights, ids = route_topk(logits, 3, renormalize)
    assert ids[3].tolist() == [0, 1, 2] and ids[4].tolist() == [7, 8, 9]
    assert torch.equal(routed, gemv_moe(x, gate_up, down, weights, ids, config))
    torch.testing.assert_close(routed, experts_reference(x, weights, ids.long(), gate_up, down),
                               rtol=1e-5, atol=1e-5)


def test_the_gemvs_that_route_themselves_refuse_what_the_router_kernel_refuses():
    gate_up, down = _experts(4, seed=23)
    x = torch.randn(2, HIDDEN, device=DEVICE)
    with pytest.raises(ValueError, match="top_k 5 of 4"):
        routed_gemv_moe(x, torch.zeros(2, 4, device=DEVICE), 5, True, gate_up, down)
    with pytest.raises(ValueError, match="contiguous rows"):
        routed_gemv_moe(x, torch.zeros(4, 2, device=DEVICE).t(), 2, True, gate_up, down)
