"""The fused MoE kernels (common/kernels/fused_moe.py) on CUDA in bf16 at Qwen3-VL-30B-A3B's expert shapes
(128 experts, hidden 2048, width 768, 8 active) against the torch reference (decoder_svc/model/moe.py):
decode batches (most experts empty), ragged prefill batches, all tokens on a few experts, top-k ties; the
layer picking the kernel under the Triton ops; and a CUDA graph replay (no host sync in the sort)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")

from decoder_svc.model.moe import experts_reference, route  # noqa: E402
from tests.gpu.graph_replay import assert_replays_as_eager  # noqa: E402

if torch.cuda.is_available():  # tests/gpu/conftest.py skips these without a device
    from common.kernels import moe_stream_gemv
    from common.kernels.fused_moe import fused_moe
    from common.kernels.moe_align import (
        align_to_blocks,
        align_to_blocks_chunked,
        align_to_blocks_torch,
        expert_order,
        expert_runs,
    )
    from common.kernels.moe_gemv import GemvConfig, gemv_moe, routed_gemv_moe
    from common.kernels.moe_route import route_topk
    from common.kernels.moe_tuning import GEMV_CONFIGS, config_name, moe_experts, run_experts

EXPERTS, HIDDEN, WIDTH, TOP_K = 128, 2048, 768, 8
if torch.cuda.is_available():
    from common.kernels.moe_tuning import DECODE_CONFIGS

    SWAPPED = tuple(c for c in DECODE_CONFIGS if c.swap_ab)


@pytest.fixture(scope="module")
def experts():
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=gen, device="cuda") / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, WIDTH, generator=gen, device="cuda") / WIDTH**0.5
    router = torch.randn(EXPERTS, HIDDEN, generator=gen, device="cuda") / HIDDEN**0.5
    return gate_up.bfloat16(), down.bfloat16(), router.bfloat16()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _check(x, gate_up, down, weights, ids) -> None:
    # what the layer calls (the measured tiling or path), and at a few tokens every GEMV candidate too
    outs = {"chosen": moe_experts(x, gate_up, down, weights, ids)}
    if x.shape[0] <= 8:
        few = GEMV_CONFIGS + (moe_stream_gemv.CONFIGS if moe_stream_gemv.usable(x, gate_up, down) else ())
        outs.update({config_name(c): run_experts(x, gate_up, down, weights, ids, c) for c in few})
    if x.shape[0] <= 64:  # the decode tilings with the operands swapped
        outs.update({config_name(c): run_experts(x, gate_up, down, weights, ids, c) for c in SWAPPED})
    # the fp32 reference over the same bf16 weights: the kernel's one rounding per product stays close;
    # the bf16 reference rounds as often, so it sits at a similar distance
    exact = experts_reference(x.float(), weights.float(), ids, gate_up.float(), down.float())
    ref = experts_reference(x, weights, ids, gate_up, down)
    for name, out in outs.items():
        assert out.dtype == torch.bfloat16 and out.shape == x.shape, name
        assert _rel_err(out, exact) < 1e-2, name
        assert _rel_err(out, exact) <= 2 * _rel_err(ref, exact) + 1e-3, name


@pytest.mark.parametrize("tokens", [1, 3, 32, 257, 1500])
def test_router_chosen_experts(experts, tokens):
    gate_up, down, router = experts
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    weights, ids = route(x @ router.t(), TOP_K, renormalize=True)
    _check(x, gate_up, down, weights, ids)


@pytest.mark.parametrize("tokens", [1, 3, 32, 512])
def test_the_router_kernel_equals_route(experts, tokens):
    """bf16 logits of the router: the same weights (to one bf16 ulp: Triton's exponentials) and, where the
    nine largest logits of a token are distinct (no tie for torch.topk to break its own way), the same
    experts in the same order."""
    _, _, router = experts
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    logits = x @ router.t()
    weights, ids = route_topk(logits, TOP_K, renormalize=True)
    ref_weights, ref_ids = route(logits, TOP_K, renormalize=True)
    torch.testing.assert_close(weights.float(), ref_weights.float(), rtol=8e-3, atol=0)
    top = logits.float().topk(TOP_K + 1, dim=-1).values
    distinct = (top[:, :-1] > top[:, 1:]).all(dim=-1)
    assert distinct.any() or tokens < 32  # bf16 logits of one token often tie among its nine largest
    assert torch.equal(ids[distinct].long(), ref_ids[distinct])


@pytest.mark.parametrize("tokens", [1, 32, 33, 512, 1536, 4096])
def test_the_alignment_kernels_equal_the_torch_sort(tokens):
    """The one-kernel sort up to 256 assignments, the two-kernel sort beyond (and at every size here)."""
    ids = torch.rand(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=-1).indices
    for block_m in (16, 32, 64, 128):
        reference = align_to_blocks_torch(ids, EXPERTS, block_m)
        for align in (align_to_blocks, align_to_blocks_chunked):
            got = align(ids, EXPERTS, block_m)
            assert torch.equal(got.sorted_rows, reference.sorted_rows), align.__name__
            assert torch.equal(got.block_expert, reference.block_expert), align.__name__
    order, ends = expert_runs(ids, EXPERTS)  # the grouped-GEMM path's sort
    ref_order, counts = expert_order(ids.reshape(-1), EXPERTS)
    assert torch.equal(order.long(), ref_order) and torch.equal(ends.long(), counts.cumsum(0))


def test_few_experts_take_every_token_and_ties(experts):
    gate_up, down, _ = experts
    x = torch.randn(300, HIDDEN, device="cuda").bfloat16()
    logits = torch.zeros(300, EXPERTS, device="cuda", dtype=torch.bfloat16)
    logits[:, :3] = 1.0  # a three-way tie on top, the rest tied below it
    weights, ids = route(logits, TOP_K, renormalize=True)
    _check(x, gate_up, down, weights, ids)


def test_replays_in_a_cuda_graph(experts):
    gate_up, down, router = experts
    x = torch.randn(8, HIDDEN, device="cuda").bfloat16()

    def chain(inp: torch.Tensor) -> torch.Tensor:  # the layer's fused path: router kernel, sort, products
        weights, ids = route_topk(inp @ router.t(), TOP_K, renormalize=True)
        return fused_moe(inp, gate_up, down, weights, ids)

    assert_replays_as_eager(chain, x, lambda s: torch.randn(8, HIDDEN, device="cuda").bfloat16() * s)


@pytest.mark.parametrize("fuse_combine", [False, True])
def test_the_gemvs_replay_in_a_cuda_graph(experts, fuse_combine):
    gate_up, down, router = experts
    x = torch.randn(2, HIDDEN, device="cuda").bfloat16()
    config = GemvConfig(fuse_combine=fuse_combine)

    def chain(inp: torch.Tensor) -> torch.Tensor:  # the GEMVs route themselves: no router kernel, no sort
        return routed_gemv_moe(inp, inp @ router.t(), TOP_K, True, gate_up, down, config)

    assert_replays_as_eager(chain, x, lambda s: torch.randn(2, HIDDEN, device="cuda").bfloat16() * s)


def test_the_tma_gemvs_replay_in_a_cuda_graph(experts):
    gate_up, down, router = experts
    x = torch.randn(2, HIDDEN, device="cuda").bfloat16()
    assert moe_stream_gemv.usable(x, gate_up, down)  # an H100 or H200

    def chain(inp: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(inp @ router.t(), TOP_K, renormalize=True)
        return moe_stream_gemv.stream_moe(inp, gate_up, down, weights, ids)

    assert_replays_as_eager(chain, x, lambda s: torch.randn(2, HIDDEN, device="cuda").bfloat16() * s)


@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_the_gemvs_that_route_themselves_equal_the_router_kernel_then_the_gemvs(experts, tokens):
    gate_up, down, router = experts
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    logits = x @ router.t()
    weights, ids = route_topk(logits, TOP_K, renormalize=True)
    for config in GEMV_CONFIGS:
        routed = routed_gemv_moe(x, logits, TOP_K, True, gate_up, down, config)
        assert torch.equal(routed, gemv_moe(x, gate_up, down, weights, ids, config)), config_name(config)


def test_the_layer_takes_the_kernel_under_triton_ops():
    from decoder_svc.model.config import TextModelConfig
    from decoder_svc.model.kernel_dispatch import TritonOps
    from decoder_svc.model.moe import SparseMoE
    from decoder_svc.model.ops import TorchOps

    cfg = TextModelConfig(model_type="moe", vocab_size=16, hidden_size=256, intermediate_size=64,
                          num_layers=1, num_heads=2, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
                          rope_theta=1e4, max_position_embeddings=64, num_experts=16, num_experts_per_tok=4,
                          moe_intermediate_size=96)
    fused = SparseMoE(cfg, TritonOps).cuda().bfloat16()
    torch.nn.init.normal_(fused.experts.gate_up_proj, std=256**-0.5)
    torch.nn.init.normal_(fused.experts.down_proj, std=96**-0.5)
    reference = SparseMoE(cfg, TorchOps).cuda().bfloat16()
    reference.load_state_dict(fused.state_dict())
    assert fused.fused and not reference.fused
    x = torch.randn(40, 256, device="cuda").bfloat16()
    assert _rel_err(fused(x), reference(x)) < 1e-2


@pytest.mark.parametrize("tokens", [1, 32, 257])
def test_fp8_experts_against_the_dequantized_reference(experts, tokens):
    """FP8 experts (--quantization fp8's per-channel layout): the kernel widens the FP8 tiles to bf16 and
    scales the fp32 accumulator; the fp32 reference over the dequantized experts is the exact value."""
    from decoder_svc.model.quant.experts import quantize_experts

    gate_up, down, router = experts
    state = {"layers.0.mlp.experts.gate_up_proj": gate_up, "layers.0.mlp.experts.down_proj": down}
    quantize_experts(state, "cuda")
    q_gate_up, s_gate_up, q_down, s_down = (state[f"layers.0.mlp.experts.{n}"] for n in (
        "gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"))
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    weights, ids = route(x @ router.t(), TOP_K, renormalize=True)
    exact = experts_reference(x.float(), weights.float(), ids, q_gate_up, q_down, s_gate_up, s_down)
    few = GEMV_CONFIGS + (moe_stream_gemv.CONFIGS if moe_stream_gemv.usable(x, q_gate_up, q_down) else ())
    # the default tiling, the swapped decode tilings, the GEMVs at few tokens
    configs = [None, *(SWAPPED if tokens <= 64 else ()), *(few if tokens <= 8 else ())]
    for config in configs:
        if config is None:
            out = fused_moe(x, q_gate_up, q_down, weights, ids, gate_up_scale=s_gate_up, down_scale=s_down)
        else:
            out = run_experts(x, q_gate_up, q_down, weights, ids, config, s_gate_up, s_down)
        assert out.dtype == torch.bfloat16 and _rel_err(out, exact) < 1e-2, config


def test_the_fp8_layer_takes_the_kernel_under_triton_ops():
    """--quantization fp8's experts (quantize_experts, then Fp8Experts in the layer): the kernel against the
    same layer under the torch ops (each expert dequantized to bf16, then the products)."""
    from decoder_svc.model.config import TextModelConfig
    from decoder_svc.model.kernel_dispatch import TritonOps
    from decoder_svc.model.moe import SparseMoE
    from decoder_svc.model.ops import TorchOps
    from decoder_svc.model.quant.experts import Fp8Experts, quantize_experts

    cfg = TextModelConfig(model_type="moe", vocab_size=16, hidden_size=256, intermediate_size=64,
                          num_layers=1, num_heads=2, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
                          rope_theta=1e4, max_position_embeddings=64, num_experts=16, num_experts_per_tok=4,
                          moe_intermediate_size=96)
    state = {"gate.weight": torch.randn(16, 256, device="cuda") / 16,
             "layers.0.mlp.experts.gate_up_proj": torch.randn(16, 192, 256, device="cuda") / 16,
             "layers.0.mlp.experts.down_proj": torch.randn(16, 256, 96, device="cuda") / 96**0.5}
    quantize_experts(state, "cuda")
    layers = []
    for ops in (TritonOps, TorchOps):
        layer = SparseMoE(cfg, ops).cuda().bfloat16()
        layer.experts = Fp8Experts(16, 256, 96, "cuda")
        layer.load_state_dict({k.removeprefix("layers.0.mlp."): v.bfloat16() if k == "gate.weight" else v
                               for k, v in state.items()})
        layers.append(layer)
    fused, reference = layers
    assert fused.fused and not reference.fused
    x = torch.randn(40, 256, device="cuda").bfloat16()
    assert _rel_err(fused(x), reference(x)) < 1e-2


def test_decode_batches_take_the_fastest_measured_tiling(experts):
    """choose_config: a decode batch's key is measured once (every candidate timed), outside a capture;
    the chosen tiling computes what the default one does; a key first met inside a graph capture takes the
    default tiling without timing anything there."""
    from common.kernels import moe_tuning as tuning

    gate_up, down, router = experts
    tuning.CHOICES.clear()
    x = torch.randn(3, HIDDEN, device="cuda").bfloat16()
    config = tuning.choose_config(x, gate_up, down, TOP_K)
    (key, choice), = tuning.CHOICES.items()
    candidates = tuning.DECODE_CONFIGS + tuning.GEMV_CONFIGS  # 4 tokens: the GEMVs are candidates too
    assert key.tokens == 4 and config in candidates and choice.config == config
    assert set(choice.times_us) <= set(candidates) and set(tuning.GEMV_CONFIGS) <= set(choice.times_us)
    assert tuning.DECODE_CONFIGS[0] in choice.times_us  # the default tiling always fits
    assert min(choice.times_us.values()) == choice.times_us[config]
    weights, ids = route_topk(x @ router.t(), TOP_K, renormalize=True)
    chosen = tuning.moe_experts(x, gate_up, down, weights, ids)
    default = fused_moe(x, gate_up, down, weights, ids, tuning.default_config(3))
    assert _rel_err(chosen, default) < 1e-2
    assert tuning.tuning_summary()[0]["tokens"] == 4

    y = torch.randn(16, HIDDEN, device="cuda").bfloat16()
    fused_moe(y, gate_up, down, *route_topk(y @ router.t(), TOP_K, True), tuning.default_config(16))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert tuning.choose_config(y, gate_up, down, TOP_K) == tuning.default_config(16)
    assert len(tuning.CHOICES) == 1
    big = torch.randn(tuning.TUNED_TOKENS + 1, HIDDEN, device="cuda").bfloat16()
    assert tuning.choose_config(big, gate_up, down, TOP_K) == tuning.default_config(big.shape[0])
    tuning.CHOICES.clear()


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
@pytest.mark.parametrize("tokens", [65, 1500])
def test_each_prefill_path_against_the_reference(experts, backend, tokens, monkeypatch):
    """MMSERVE_MOE_PREFILL fixes the prefill path: torch's grouped GEMM (CUTLASS's on Hopper) and the Triton
    tiling both stay as close to the fp32 reference as the bf16 reference does."""
    from common.kernels import moe_tuning as tuning

    monkeypatch.setenv(tuning.PREFILL_ENV, backend)
    gate_up, down, router = experts
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    assert tuning.prefill_backend(x, gate_up, down, TOP_K) == backend
    _check(x, gate_up, down, *route_topk(x @ router.t(), TOP_K, renormalize=True))


def test_prefill_takes_the_faster_measured_path(experts, monkeypatch):
    """auto: a prefill size (rounded up to a power of two) is timed once on both paths, the smaller sizes
    with it, and takes the faster; inside a graph capture, and for FP8 experts, the Triton tiling without
    timing anything."""
    from common.kernels import moe_tuning as tuning

    monkeypatch.delenv(tuning.PREFILL_ENV, raising=False)
    gate_up, down, _ = experts
    tuning.PREFILL_CHOICES.clear()
    x = torch.randn(300, HIDDEN, device="cuda").bfloat16()
    backend = tuning.prefill_backend(x, gate_up, down, TOP_K)
    assert sorted(k.tokens for k in tuning.PREFILL_CHOICES) == [128, 256, 512]  # the smaller sizes too
    choice = next(c for k, c in tuning.PREFILL_CHOICES.items() if k.tokens == 512)
    assert choice.backend == backend and set(choice.times_us) == {"triton", "grouped_mm"}
    assert choice.times_us[backend] == min(choice.times_us.values())
    assert tuning.prefill_backend(x[:280], gate_up, down, TOP_K) == backend  # the same key, not re-timed
    tuning.prefill_backend(x[:100], gate_up, down, TOP_K)
    assert len(tuning.PREFILL_CHOICES) == 3
    assert any(row.get("chosen") == backend for row in tuning.tuning_summary())

    y = torch.randn(1000, HIDDEN, device="cuda").bfloat16()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert tuning.prefill_backend(y, gate_up, down, TOP_K) == "triton"
    fp8 = gate_up.to(torch.float8_e4m3fn)
    assert tuning.prefill_backend(y, fp8, down.to(torch.float8_e4m3fn), TOP_K) == "triton"
    assert len(tuning.PREFILL_CHOICES) == 3
