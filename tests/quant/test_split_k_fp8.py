"""The split-K FP8 weight-only kernel and its stream-K form (common/kernels/fp8_split_k.py)
against the torch reference (dequantize, then an fp32 product). On CPU through Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 and patches its scalar conversion, so the kernel's K loop,
bounded by kernel arguments, runs), with fp16 activations (the interpreter's bf16 tl.dot multiplies raw
bits): small odd shapes so that every mask, an empty last K split and the counters' reuse are exercised.
tests/gpu/test_fp8_gpu.py runs the real shapes, every autotuned config, graphs and determinism."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from common.kernels import fp8_linear  # noqa: E402
from common.kernels import fp8_split_k as t  # noqa: E402
from decoder_svc.model.quant.fp8 import ScaleBlock, dequantize, per_channel_block, quantize_per_channel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, scale = quantize_per_channel(torch.randn(n, k, generator=gen) / k**0.5)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), b if b is None else b.to(DEVICE)


def _reference(x, q, scale, block, bias):
    out = x.float() @ dequantize(q, scale, block).t()
    return out if bias is None else out + bias.float()


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # fp8 -> fp16 and the fp32 products are exact; the sums differ from torch's in order only, then one
    # rounding to the output dtype: within one output ulp (2**-10 relative for fp16) plus fp32 noise.
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, rtol=2**-10, atol=1e-4)


# Ragged N and K: K = 200 with BLOCK_K 32 and SPLIT_K 4 gives splits of 64 columns, the last one 8 wide;
# K = 40 with SPLIT_K 4 leaves the last split empty (its partial is zero and it still counts).
@pytest.mark.parametrize("m, n, k", [(2, 70, 200), (3, 40, 40), (17, 33, 96)])
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("swap", [False, True])
def test_per_channel_matches_reference(m, n, k, split, bias, swap):
    x, q, scale, b = _case(m, n, k, torch.float16, bias, seed=m * 100 + n + k)
    config = {"BLOCK_N": 32, "BLOCK_K": 32 if k > 40 else 16, "SPLIT_K": split, "SWAP_AB": swap}
    out = t.split_k_fp8(x, q, scale, per_channel_block(k), b, config=config)
    assert out.shape == (m, n)
    _close(out, _reference(x, q, scale, per_channel_block(k), b))
    assert not t._counters[torch.device(DEVICE)].any()  # every tile's last program reset its counter


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("swap", [False, True])
def test_block_scaled_matches_reference(split, swap):
    # Blocks of 32 rows x 64 columns; BLOCK_K 32 divides 64, so a K block never straddles two scales.
    n, k, block = 70, 192, ScaleBlock(32, 64)
    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).to(DEVICE)
    scale = (torch.rand(block.grid(n, k), generator=gen) * 1e-2 + 1e-3).to(DEVICE)
    x = torch.randn(5, k, generator=gen).to(torch.float16).to(DEVICE)
    out = t.split_k_fp8(x, q, scale, block, None,
                        config={"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": split, "SWAP_AB": swap})
    _close(out, _reference(x, q, scale, block, None))


def test_reference_detects_a_wrong_scale():
    # The comparison can fail: the same product with one channel's scale doubled does not pass it.
    x, q, scale, _ = _case(4, 40, 64, torch.float16, False, seed=9)
    out = t.split_k_fp8(x, q, scale, per_channel_block(64), None,
                        config={"BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2})
    wrong = scale.clone()
    wrong[7] *= 2
    with pytest.raises(AssertionError):
        _close(out, _reference(x, q, wrong, per_channel_block(64), None))


def test_routing_and_refusals():
    x, q, scale, _ = _case(4, 40, 64, torch.float16, False, seed=3)
    # weight_only_fp8 sends 2..64 rows to split-K (the interpreter's default config).
    _close(fp8_linear.weight_only_fp8(x, q, scale, per_channel_block(64), None),
           _reference(x, q, scale, per_channel_block(64), None))
    with pytest.raises(ValueError, match="does not divide"):
        t.split_k_fp8(x, q, scale, ScaleBlock(1, 48), None, config=dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=1))
    with pytest.raises(ValueError, match="BLOCK_N"):
        t.split_k_fp8(x, q, scale, per_channel_block(64), None,
                      config=dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1))


def test_config_pruning():
    cfgs = [c.kwargs for c in t.split_k_configs()]
    assert any(c["SPLIT_K"] == 1 for c in cfgs) and any(c["SPLIT_K"] > 1 for c in cfgs)
    # A narrow matrix may split; 128-column scale blocks keep only BLOCK_K dividing 128.
    assert any(c["SPLIT_K"] == 8 and t._split_k_fits(c, 4096, 4096, True, 4096) for c in cfgs)
    assert all(c["BLOCK_K"] <= 128 for c in cfgs if t._split_k_fits(c, 4096, 4096, False, 128))
    # A very wide matrix has programs enough: no splits beyond the cap of programs per SM.
    assert not any(c["SPLIT_K"] == 8 and t._split_k_fits(c, 37888, 3584, True, 3584) for c in cfgs)
    # Never more splits than K blocks.
    assert not any(c["SPLIT_K"] > 1 and t._split_k_fits(c, 1000, 128, True, 128) and c["BLOCK_K"] == 128
                   for c in cfgs)


def test_swapped_product_takes_bf16_activations_and_saturates_beyond_fp16():
    # The swapped product widens FP8 and the activations to fp16 itself, so bf16 activations work in the
    # interpreter too. An activation beyond fp16's range (bf16 holds it) saturates at FP16_LIMIT instead
    # of turning the output into inf. rtol: one bf16 ulp (the interpreter's store to bf16 may truncate).
    x, q, scale, _ = _case(3, 40, 64, torch.bfloat16, False, seed=11)
    block = per_channel_block(64)
    config = {"BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2, "SWAP_AB": True}
    out = t.split_k_fp8(x, q, scale, block, None, config=config)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(x, q, scale, block, None), rtol=2**-7, atol=1e-3)
    big = x.clone()
    big[1, 5] = 3e5
    out = t.split_k_fp8(big, q, scale, block, None, config=config)
    assert torch.isfinite(out.float()).all()
    clamped = big.clone()
    clamped[1, 5] = t.FP16_LIMIT.value
    torch.testing.assert_close(out.float(), _reference(clamped, q, scale, block, None), rtol=2**-7, atol=1e-2)


def _parts_per_tile(n_blocks: int, k_tiles: int, programs: int) -> list[int]:
    """How many programs' runs meet each output tile in the stream-K form (the kernel's arithmetic)."""
    run = -(-n_blocks * k_tiles // programs)
    return [((b + 1) * k_tiles - 1) // run - (b * k_tiles) // run + 1 for b in range(n_blocks)]


@pytest.mark.parametrize("n, k", [(4096, 4096), (22016, 4096), (4096, 11008), (12288, 4096), (70, 200),
                                  (33, 4096), (1000, 352)])
@pytest.mark.parametrize("block_n, block_k", [(64, 128), (128, 128), (64, 256)])
@pytest.mark.parametrize("per_sm", [1, 2, 3])
def test_stream_k_grid_keeps_every_tile_within_the_workspace(n, k, block_n, block_k, per_sm):
    programs = t.stream_k_programs(n, k, block_n, block_k, per_sm)
    n_blocks, k_tiles = -(-n // block_n), -(-k // block_k)
    assert 1 <= programs <= min(per_sm * t._sms(), n_blocks * k_tiles)
    assert max(_parts_per_tile(n_blocks, k_tiles, programs)) <= t.MAX_STREAM_PARTS.value


def _stream_config(block_n: int, block_k: int, swap: bool, per_sm: int = 1) -> dict:
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": 1, "SWAP_AB": swap, "PROGRAMS_PER_SM": per_sm}


# Programs = per_sm x SMs (patched): 1 program holds every tile whole; 2, 5 and 7 programs cut tiles'
# K ranges in different places (K = 200 is 7 K blocks of 32, the last 8 wide; n = 70 is 3 N blocks,
# the last 6 wide), 21 programs give every tile to 7 programs, and K = 630 (20 K blocks) over 20 programs
# gives one tile to MAX_STREAM_PARTS = 8.
@pytest.mark.parametrize("k, sms, most_parts", [(200, 1, 1), (200, 2, 2), (200, 5, 3), (200, 7, 3),
                                                (200, 21, 7), (630, 20, 8)])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("m, bias", [(3, True), (17, False)])
def test_stream_k_matches_reference(monkeypatch, k, sms, most_parts, swap, m, bias):
    monkeypatch.setattr(t, "_sms", lambda: sms)
    n = 70
    x, q, scale, b = _case(m, n, k, torch.float16, bias, seed=sms * 10 + m)
    config = _stream_config(32, 32, swap)
    assert max(_parts_per_tile(3, -(-k // 32), t.stream_k_programs(n, k, 32, 32, 1))) == most_parts
    out = t.split_k_fp8(x, q, scale, per_channel_block(k), b, config=config)
    _close(out, _reference(x, q, scale, per_channel_block(k), b))
    assert not t._counters[torch.device(DEVICE)].any()  # every tile's last program reset its counter
    assert torch.equal(out, t.split_k_fp8(x, q, scale, per_channel_block(k), b, config=config))


def test_stream_k_block_scaled_matches_reference(monkeypatch):
    monkeypatch.setattr(t, "_sms", lambda: 4)
    n, k, block = 70, 192, ScaleBlock(32, 64)
    gen = torch.Generator().manual_seed(6)
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).to(DEVICE)
    scale = (torch.rand(block.grid(n, k), generator=gen) * 1e-2 + 1e-3).to(DEVICE)
    x = torch.randn(5, k, generator=gen).to(torch.float16).to(DEVICE)
    for swap in (False, True):
        out = t.split_k_fp8(x, q, scale, block, None, config=_stream_config(32, 32, swap))
        _close(out, _reference(x, q, scale, block, None))


def test_stream_k_configs_are_offered_and_checked():
    assert not any(c.kwargs.get("PROGRAMS_PER_SM") for c in t.split_k_configs("0"))  # the default
    assert all(c.kwargs.get("PROGRAMS_PER_SM") for c in t.split_k_configs("only"))
    stream = [c for c in t.split_k_configs("1") if c.kwargs.get("PROGRAMS_PER_SM")]
    assert stream and all(c.kwargs["THREADS"] == 32 * c.num_warps for c in stream)
    assert all(t._workspace_depth(c.kwargs) == t.MAX_STREAM_PARTS.value for c in stream)
    x, q, scale, _ = _case(4, 40, 64, torch.float16, False, seed=3)
    with pytest.raises(ValueError, match="THREADS"):
        t.split_k_fp8(x, q, scale, per_channel_block(64), None,
                      config={**_stream_config(32, 32, False), "THREADS": 64, "num_warps": 4})


class _RecordingLaunch:
    """Stands in for the autotuned kernel: records the workspace of each launch, runs nothing."""

    def __init__(self) -> None:
        self.workspaces: list[torch.Tensor] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.workspaces.append(args[5])  # split_k_fp8's args: x, weight, scale, bias, out, ws, ...
        return launch


@pytest.mark.parametrize("stream_k", ["0", "1"])
@pytest.mark.parametrize(("m", "n", "k"), [(4, 4096, 4096), (32, 1000, 512), (3, 37888, 3584)])
def test_the_autotuned_workspace_holds_the_deepest_config_that_may_run(monkeypatch, stream_k, m, n, k):
    """Without a fixed config the autotuner may pick any configuration that fits the matrix, so the
    partials' workspace is sized for the deepest of them (a shallower one would be written past its end).
    Host-side sizing only: the launch is recorded, not run."""
    configs = t.split_k_configs(stream_k)
    monkeypatch.setattr(t, "split_k_configs", lambda stream=None: configs)
    monkeypatch.setattr(t, "_INTERPRETED", False)
    launch = _RecordingLaunch()
    monkeypatch.setattr(t, "_split_k", launch)
    x = torch.zeros(m, k, dtype=torch.float16)
    q = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.ones(n, 1, dtype=torch.float32)
    t.split_k_fp8(x, q, scale, per_channel_block(k), None)
    fits = [c.kwargs for c in configs if t._split_k_fits(c.kwargs, n, k, True, k)]
    deepest = max(t.MAX_STREAM_PARTS.value if c.get("PROGRAMS_PER_SM") else c["SPLIT_K"] for c in fits)
    assert len({c.get("PROGRAMS_PER_SM", 0) or c["SPLIT_K"] for c in fits}) > 1  # depths differ
    (ws,) = launch.workspaces
    assert ws.dtype == torch.float32
    assert tuple(ws.shape) == ((deepest, m, n) if deepest > 1 else (1,))
