"""The batch-invariant product's split of K (common/kernels/invariant_matmul.py) in Triton's interpreter:
for shapes whose K is not a whole number of splits and whose N is not of tiles, in bf16 and fp32, with the
configuration `invariant_tiles` gives and with others, every row of an M-row product (M = 1..40 and
more) is the same bits as that row computed alone, and within rounding of torch's fp32 product.

The interpreter's dot is numpy's, whose sums depend on a row's place inside a tile (BLAS edge kernels), so
"alone" keeps the row's place: filler rows before it, drawn afresh, up to its place in its tile (none for
rows at place 0, computed truly alone). On a GPU every row of a tile sums alike and
tests/gpu/test_invariant_matmul_gpu.py compares rows at any place, compiled."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from common.kernels.invariant_matmul import (  # noqa: E402
    MAX_SPLIT_K,
    MIN_BLOCKS_PER_SPLIT,
    PROGRAMS_PER_SM,
    InvariantTiles,
    invariant_matmul,
    invariant_tiles,
)

EPS32 = torch.finfo(torch.float32).eps

# (N, K, tiles): None is invariant_tiles' own configuration (on the CPU, an H100's 132 SMs'), which splits
# these K (1100 in bf16: 2 splits of 640, the second 460; in fp32: 7 of 160, the last 140).
CASES = [
    (70, 1100, None),
    (37, 53, InvariantTiles(16, 32, 16, split_k=2, k_span=32)),  # the last split 21 deep, partly masked
    (50, 96, InvariantTiles(16, 32, 16, split_k=2, k_span=48)),  # K a whole number of splits
    (24, 40, InvariantTiles(16, 16, 16)),  # no split
    (5, 7, InvariantTiles(16, 16, 16, split_k=1)),  # smaller than one tile
]


def _operands(n: int, k: int, rows: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, w, bias


def _block_m(tiles: InvariantTiles | None, n: int, k: int, dtype: torch.dtype) -> int:
    return (tiles or invariant_tiles(n, k, dtype, 132)).block_m


def _sums(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, tiles: InvariantTiles | None) -> torch.Tensor:
    """The product's fp32 sums before their rounding to x's dtype (bf16 would hide most orders of a sum)."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    return invariant_matmul(x, w.t(), bias, out=out, tiles=tiles)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,tiles", CASES)
def test_every_row_is_the_same_bits_alone_as_in_any_batch(n, k, tiles, dtype):
    rows = 70
    x, w, bias = _operands(n, k, rows, dtype)
    full = _sums(x, w, bias, tiles)
    # The interpreter takes seconds for the deep K of invariant_tiles' own case: fewer row counts there.
    counts = [*range(1, 41), 53, 69] if tiles else [1, 2, 3, 7, 16, 17, 31, 40, 69]
    for m in counts:  # the first m rows: each keeps its place in its tile
        assert torch.equal(_sums(x[:m], w, bias, tiles), full[:m]), m
    block_m = _block_m(tiles, n, k, dtype)
    filler = torch.Generator().manual_seed(1)
    for r in [0, 1, 6, 15, 16, 17, 33, 69]:
        before = torch.randn(r % block_m, k, generator=filler).to(dtype)
        assert torch.equal(_sums(torch.cat((before, x[r:r + 1])), w, bias, tiles)[-1], full[r]), r
    # rounded to x's dtype, once per element: the same bits too
    rounded = invariant_matmul(x, w.t(), bias, tiles=tiles)
    assert torch.equal(invariant_matmul(x[:17], w.t(), bias, tiles=tiles), rounded[:17])
    assert torch.equal(rounded, full.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,tiles", CASES)
def test_the_product_is_torchs_within_rounding(n, k, tiles, dtype):
    x, w, bias = _operands(n, k, 40, dtype, seed=2)
    got = invariant_matmul(x, w.t(), bias, tiles=tiles).float()
    want = x.float() @ w.float().t() + bias.float()
    # fp32 sums in two orders differ by a few eps of the sum of the terms' magnitudes; a bf16 result is
    # also rounded once, to half a bf16 unit in the last place.
    magnitude = x.float().abs() @ w.float().abs().t() + bias.float().abs()
    allowed = 4 * EPS32 * magnitude
    if dtype == torch.bfloat16:
        _, exponent = torch.frexp(want)
        allowed = allowed + torch.ldexp(torch.ones_like(want), exponent - 9)  # half of 2^(e - 1 - 7)
    assert ((got - want).abs() <= allowed).all()


def test_a_split_product_on_the_cpu_equals_a_one_pass_one_to_rounding():
    # The split changes the order of the sum, not what is summed: a lost or doubled K range would not be
    # within rounding of the unsplit product.
    x, w, _ = _operands(33, 200, 9, torch.float32, seed=3)
    one = invariant_matmul(x, w.t(), tiles=InvariantTiles(16, 16, 16))
    split = invariant_matmul(x, w.t(), tiles=InvariantTiles(16, 16, 16, split_k=4, k_span=64))
    torch.testing.assert_close(split, one, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sms", [78, 132, 144])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288), (151936, 4096),
                                 (3584, 18944), (1152, 4304), (70, 1100)])
def test_the_configuration_fills_the_gpu_with_whole_non_empty_splits(n, k, dtype, sms):
    tiles = invariant_tiles(n, k, dtype, sms)
    n_tiles = -(-n // tiles.block_n)
    k_blocks = -(-k // tiles.block_k)
    programs = n_tiles * tiles.split_k  # one row tile's
    # the GPU filled, or as many ranges as MIN_BLOCKS_PER_SPLIT blocks each or MAX_SPLIT_K allow
    assert programs >= PROGRAMS_PER_SM * sms or tiles.split_k >= min(k_blocks // MIN_BLOCKS_PER_SPLIT,
                                                                      MAX_SPLIT_K)
    if tiles.split_k == 1:
        assert tiles.k_span == 0
        return
    assert tiles.k_span % tiles.block_k == 0 and tiles.k_span // tiles.block_k >= MIN_BLOCKS_PER_SPLIT
    assert (tiles.split_k - 1) * tiles.k_span < k <= tiles.split_k * tiles.k_span  # none empty, all of K


def test_a_configuration_whose_splits_leave_k_uncovered_is_refused():
    x, w, _ = _operands(16, 100, 2, torch.float32)
    with pytest.raises(ValueError, match="do not cover"):
        invariant_matmul(x, w.t(), tiles=InvariantTiles(16, 16, 16, split_k=2, k_span=32))
    with pytest.raises(ValueError, match="whole blocks"):
        InvariantTiles(16, 16, 16, split_k=2, k_span=40)


def test_the_kept_counters_are_left_zeroed_and_never_replaced(monkeypatch):
    from common.kernels import invariant_matmul as module

    monkeypatch.setattr(module, "_counters", {})
    monkeypatch.setattr(module, "KEPT_COUNTERS", 4)
    tiles = InvariantTiles(16, 16, 16, split_k=2, k_span=32)
    x, w, _ = _operands(40, 50, 33, torch.float32)
    small = invariant_matmul(x[:16], w.t(), tiles=tiles)  # 1 x 3 tiles: the kept buffer
    kept = module._counters[torch.device("cpu")]
    large = invariant_matmul(x, w.t(), tiles=tiles)  # 3 x 3 tiles: counters of its own
    assert module._counters[torch.device("cpu")] is kept and kept.numel() == 4
    assert not kept.any()
    assert torch.equal(large[:16], small)


def test_the_tile_shapes_take_an_override_for_16_bit_operands():
    from common.kernels.invariant_matmul import _tile_shapes

    assert _tile_shapes(None)[2][0] == 16
    shapes = _tile_shapes("64x128x64/8/3")
    assert shapes[2] == (64, 128, 64, 8, 3) and shapes[4] == _tile_shapes(None)[4]
    with pytest.raises(ValueError, match="BMxBNxBK"):
        _tile_shapes("64x128/8/3")


def test_the_split_can_be_turned_off_for_the_process(monkeypatch):
    """MMSERVE_INVARIANT_SPLIT_K=0 (read at import): every configuration sums all of K in one program."""
    from common.kernels import invariant_matmul as module

    assert invariant_tiles(4096, 4096, torch.bfloat16, 132).split_k > 1
    monkeypatch.setattr(module, "SPLIT_K_ON", False)
    invariant_tiles.cache_clear()
    try:
        tiles = invariant_tiles(4096, 4096, torch.bfloat16, 132)
        assert tiles.split_k == 1 and tiles.k_span == 0
    finally:
        invariant_tiles.cache_clear()
