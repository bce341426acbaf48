"""The batch-invariant product (common/kernels/invariant_matmul.py) compiled, at real weight shapes in
bf16: every row is the same bits alone as at any place of any batch (1..1500 rows), in a CUDA graph as
eagerly, with and without a bias, and within rounding of the fp32 product; the narrow weights' products
split K (the configuration this device gets)."""

from __future__ import annotations

import pytest
import torch

from common.kernels import invariant_matmul as module
from common.kernels.invariant_matmul import device_sms, invariant_matmul, invariant_tiles

ROWS = 1500  # not a whole number of row tiles

# N x K: Qwen3-VL-8B's qkv, o, gate_up, down and head; Qwen2.5-VL-7B's qkv (with its bias) and down.
SHAPES = [(6144, 4096, False), (4096, 4096, False), (24576, 4096, False), (4096, 12288, False),
          (151936, 4096, False), (4608, 3584, True), (3584, 18944, False)]


def _operands(n: int, k: int, bias: bool):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(ROWS, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    return x, w, b


@pytest.mark.parametrize("n,k,bias", SHAPES)
def test_every_row_is_the_same_bits_alone_and_at_any_place_of_any_batch(n, k, bias):
    x, w, b = _operands(n, k, bias)
    full = invariant_matmul(x, w.t(), b)
    for m in (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 40, 64, 100, 511, 1000):
        assert torch.equal(invariant_matmul(x[ROWS - m:], w.t(), b), full[ROWS - m:]), m  # other places
        assert torch.equal(invariant_matmul(x[:m], w.t(), b), full[:m]), m
    for r in (0, 1, 5, 15, 16, 17, 777, ROWS - 1):
        assert torch.equal(invariant_matmul(x[r:r + 1], w.t(), b), full[r:r + 1]), r
    want = x.float() @ w.float().t() + (b.float() if bias else 0)
    torch.testing.assert_close(full.float(), want, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("rows", [1, 32])
def test_a_graph_replays_the_eager_bits(rows):
    n, k = 4096, 4096  # split K on any GPU of many SMs
    assert invariant_tiles(n, k, torch.bfloat16, device_sms(torch.device("cuda"))).split_k > 1
    x, w, _ = _operands(n, k, False)
    full = invariant_matmul(x, w.t())
    static = x[:rows].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = invariant_matmul(static, w.t())
    for start in (0, 333, ROWS - rows):
        static.copy_(x[start:start + rows])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, full[start:start + rows]), start


def test_products_beyond_the_kept_counters_take_their_own_and_leave_the_kept_zeroed(monkeypatch):
    x, w, _ = _operands(4096, 4096, False)
    full = invariant_matmul(x, w.t())
    kept = module._counters[x.device]
    monkeypatch.setattr(module, "KEPT_COUNTERS", 64)  # 1500 rows of 4096 columns: far more tiles
    assert torch.equal(invariant_matmul(x, w.t()), full)
    assert module._counters[x.device] is kept
    torch.cuda.synchronize()
    assert not kept.any()
