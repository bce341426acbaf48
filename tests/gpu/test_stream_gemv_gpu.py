"""The TMA-streamed one-row product (stream_gemv.py) on a Hopper GPU: every config against the fp32
reference (bf16, fp16 and per-channel FP8 weights, with and without a bias, rows and columns that are no
multiple of a tile), the same bits call after call, inside a CUDA graph, its measured choice, and the FP8
product's two one-row kernels (TMA-streamed and Triton) agreeing through weight_only_fp8."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("triton.experimental.gluon")

from decoder_svc.model.quant.fp8 import per_channel_block, quantize_per_channel  # noqa: E402

if torch.cuda.is_available():  # tests/gpu/conftest.py skips these without a device
    from common.kernels import stream_gemv as sg
    from common.kernels.fp8_linear import weight_only_fp8

    if not sg.available():
        pytest.skip("the TMA-streamed GEMV needs Hopper", allow_module_level=True)

# (N, K): llava's o and down; rows no multiple of any BLOCK_N with a last K tile partly outside.
SHAPES = [(4096, 4096), (4096, 11008), (1000, 4144)]


def _case(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device="cuda") / k**0.5
    x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16) if bias else None
    if dtype == torch.float8_e4m3fn:
        q, scale = quantize_per_channel(w.to(torch.bfloat16))
        ref = x.float() @ (q.float() * scale.reshape(-1, 1)).t()
        weight = q
    else:
        weight, scale = w.to(dtype), None
        ref = x.float() @ weight.float().t()
    if b is not None:
        ref = ref + b.float()
    return x, weight, scale, b, ref


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("config", sg.CONFIGS if torch.cuda.is_available() else [], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n,k", SHAPES)
def test_every_config_matches_the_reference(n, k, dtype, config):
    x, weight, scale, bias, ref = _case(n, k, dtype, bias=n == 1000, seed=n + k)
    if not config.takes(weight):  # two tiles a stage, an odd count of tiles: refused, never chosen
        with pytest.raises(ValueError, match="whole stages"):
            sg.stream_gemv(x, weight, scale, bias, config=config)
        return
    out = sg.stream_gemv(x, weight, scale, bias, config=config)
    assert out.shape == (1, n) and out.dtype == x.dtype
    assert _rel_err(out, ref) < 8e-3  # one bf16 rounding of the fp32 sum
    assert torch.equal(out, sg.stream_gemv(x, weight, scale, bias, config=config))  # deterministic


def test_replays_in_a_cuda_graph_with_new_activations():
    x, weight, scale, _, _ = _case(4096, 11008, torch.float8_e4m3fn, bias=False, seed=1)
    sg.stream_gemv(x, weight, scale)  # measured outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sg.stream_gemv(x, weight, scale)
    for factor in (0.5, -3.0):
        x.copy_(x * factor)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, sg.stream_gemv(x, weight, scale))


def test_choose_times_every_config_and_the_rival_and_takes_the_fastest(monkeypatch):
    monkeypatch.setattr(sg, "CHOICES", {})
    x, weight, scale, _, ref = _case(4096, 4096, torch.float8_e4m3fn, bias=False, seed=2)

    def slow_rival(w, s):  # an fp32 product: several times the bytes of the FP8 stream
        return x.float() @ (w.float() * s.reshape(-1, 1)).t()

    config = sg.choose(x, weight, scale, rival=slow_rival, rival_name="fp32")
    choice = next(iter(sg.CHOICES.values()))
    assert set(choice.times_us) == {c.name for c in sg.CONFIGS} | {"fp32"}
    assert config is not None and choice.times_us[config.name] == min(choice.times_us.values())
    assert _rel_err(sg.stream_gemv(x, weight, scale, config=config), ref) < 8e-3


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_one_row_products_agree_through_weight_only_fp8(bias):
    x, weight, scale, b, ref = _case(12288, 4096, torch.float8_e4m3fn, bias=bias, seed=3)
    block = per_channel_block(4096)
    streamed = weight_only_fp8(x, weight, scale, block, b, stream=True)
    triton_gemv = weight_only_fp8(x, weight, scale, block, b, stream=False)
    chosen = weight_only_fp8(x, weight, scale, block, b)
    for out in (streamed, triton_gemv, chosen):
        assert _rel_err(out, ref) < 8e-3
