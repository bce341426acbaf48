"""The one-row fused products (decode_gemv.py) at the real projection shapes on CUDA, autotuned: against
the separate Triton op + the module's product (bf16, and per-channel FP8), inside a CUDA graph too, and
TritonOps' measured choice beside the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")

from decoder_svc.model.ops import TorchOps  # noqa: E402
from decoder_svc.model.quant.fp8 import per_channel_block, quantize_per_channel  # noqa: E402
from decoder_svc.model.quant.linear import Fp8Linear  # noqa: E402
from tests.gpu.graph_replay import assert_replays_as_eager  # noqa: E402

if torch.cuda.is_available():  # tests/gpu/conftest.py skips these without a device
    from common.kernels import decode_gemv as g
    from decoder_svc.model import kernel_dispatch as d
    from decoder_svc.model.kernel_dispatch import TritonOps

# (N, K, prologue): Qwen2.5-VL-7B's q/k/v (bias), o, gate/up, down; llava's down (K = 11008); a head.
SHAPES = [(4608, 3584, "norm"), (3584, 3584, "plain"), (37888, 3584, "norm"), (3584, 18944, "silu"),
          (4096, 11008, "silu"), (32000, 4096, "norm")]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _linear(n: int, k: int, bias: bool, gen: torch.Generator) -> nn.Linear:
    lin = nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen, device="cuda") / k**0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen, device="cuda"))
    return lin


def _fp8(lin: nn.Linear) -> Fp8Linear:
    n, k = lin.weight.shape
    q, scale = quantize_per_channel(lin.weight.detach())
    fp8 = Fp8Linear(k, n, per_channel_block(k), TritonOps, lin.bias is not None, torch.bfloat16, "cuda")
    with torch.no_grad():
        fp8.weight.copy_(q)
        fp8.weight_scale.copy_(scale)
        if lin.bias is not None:
            fp8.bias.copy_(lin.bias)
    return fp8


def _case(n, k, prologue, fp8, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lin = _linear(n, k, bias=prologue == "norm", gen=gen)
    proj = _fp8(lin) if fp8 else lin
    width = 2 * k if prologue == "silu" else k
    x = (torch.randn(1, width, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    residual = (torch.randn(1, k, generator=gen, device="cuda") * 4).to(torch.bfloat16)
    weight = (torch.rand(k, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)
    return proj, x, residual, weight


def _separate(prologue, proj, x, residual, weight):
    if prologue == "norm":
        h, new_residual = TritonOps.rms_norm(x, weight, 1e-6, residual.clone())
        return proj(h), new_residual
    if prologue == "silu":
        return proj(TritonOps.silu_and_mul(x)), None
    return proj(x), None


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n,k,prologue", SHAPES)
def test_fused_matches_separate(n, k, prologue, fp8):
    proj, x, residual, weight = _case(n, k, prologue, fp8, seed=n + k)
    w = d.gemv_weight(proj)
    kind = {"norm": g.RMS_NORM, "silu": g.SILU_MUL, "plain": g.PLAIN}[prologue]
    res_in = residual.clone() if kind == g.RMS_NORM else None
    out, new_residual = g.fused_gemv(x, w, kind, res_in, weight if kind == g.RMS_NORM else None, 1e-6)
    want, want_residual = _separate(prologue, proj, x, residual, weight)
    assert _rel_err(out, want) < 1e-2
    if kind == g.RMS_NORM:
        assert torch.equal(new_residual, want_residual)
        assert torch.equal(res_in, residual)  # the input residual is not written


def test_fused_kernel_replays_in_a_cuda_graph():
    proj, x, residual, weight = _case(4608, 3584, "norm", False, seed=3)
    w = d.gemv_weight(proj)
    g.fused_gemv(x, w, g.RMS_NORM, residual, weight, 1e-6)  # autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_residual = g.fused_gemv(x, w, g.RMS_NORM, residual, weight, 1e-6)
    x.copy_(x * 0.5)
    graph.replay()
    want, want_residual = _separate("norm", proj, x, residual, weight)
    assert _rel_err(out, want) < 1e-2 and torch.equal(new_residual, want_residual)


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_triton_ops_choose_and_agree_with_the_reference(mode, monkeypatch):
    monkeypatch.setattr(d, "CHOICES", d.GemvChoices(mode))
    proj, x, residual, weight = _case(4608, 3584, "norm", False, seed=5)
    out, new_residual = TritonOps.norm_linear(x, residual.clone(), weight, 1e-6, proj)
    want, want_residual = TorchOps.norm_linear(x, residual, weight, 1e-6, proj)
    assert _rel_err(out, want) < 1e-2 and torch.equal(new_residual, want_residual)
    gate_up = (torch.randn(1, 2 * 3584, device="cuda") * 2).to(torch.bfloat16)
    down = _linear(3584, 3584, False, torch.Generator(device="cuda").manual_seed(6))
    assert _rel_err(TritonOps.act_linear(gate_up, down), TorchOps.act_linear(gate_up, down)) < 1e-2
    assert _rel_err(TritonOps.linear(x, proj), TorchOps.linear(x, proj)) < 1e-2
    if mode == "auto":  # one measurement per key, each recorded: the fused ops' and, for their separate
        # side, the plain products' (linear's choice)
        assert {(k.n, k.k, k.prologue) for k in d.CHOICES.timings} == {
            (4608, 3584, g.RMS_NORM), (3584, 3584, g.SILU_MUL), (4608, 3584, g.PLAIN), (3584, 3584, g.PLAIN)}


@pytest.mark.parametrize("fp8", [False, True])
def test_a_chain_of_products_in_a_cuda_graph_reads_each_input_after_it_is_written(fp8):
    """Programmatic dependent launch (pdl.py) starts each one-row product before the one before it has
    ended; it must still read that one's output, not what the buffer held before. A chain of 24 square
    products (weights of unit gain: the activations keep their scale), each reading the last one's
    output, two norms between, replayed in a graph with a new
    first input: the same bits as the chain run eagerly (every kernel is deterministic)."""
    from common.kernels.fp8_linear import weight_only_fp8

    gen = torch.Generator(device="cuda").manual_seed(8)
    projs = [_linear(4096, 4096, False, gen) for _ in range(4)]
    weights = [_fp8(p) for p in projs] if fp8 else projs
    gemv = [d.gemv_weight(w) for w in weights]
    norm_w = (torch.rand(4096, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)

    def chain(x: torch.Tensor) -> torch.Tensor:
        for i in range(24):
            if i % 12 == 6:
                x, _ = TritonOps.rms_norm(x, norm_w, 1e-6)
            w = weights[i % 4]
            if fp8 and i % 2:
                x = weight_only_fp8(x, w.weight, w.weight_scale, per_channel_block(4096), None)
            else:
                x, _ = g.fused_gemv(x, gemv[i % 4])
        return x

    def new_input(scale: float) -> torch.Tensor:
        return (torch.randn(1, 4096, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    x = (torch.randn(1, 4096, generator=gen, device="cuda")).to(torch.bfloat16)
    assert_replays_as_eager(chain, x, new_input)
