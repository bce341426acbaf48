"""The Triton vision attention kernel (common/kernels/vision_attention.py) in Triton's interpreter (tests/
conftest.py sets TRITON_INTERPRET=1 on a CPU host) against one softmax(q kᵀ * scale) v per sequence, in fp32:
one sequence, uneven lengths (an empty one, lengths off the block size), many short windows; head dims 72
and 80 (padded to 80 inside the kernel); with and without the host's block map; q/k/v as strided views of
one qkv product. Then its place behind common/vision/attention.py's switch (MMSERVE_VISION_ATTENTION) and
in both Qwen towers. And compiled for Hopper (sm_90) here, without a GPU, in a child process (the session
runs the interpreter): tensor-core products (wgmma) and 16-byte asynchronous copies, no scalar loads.
Run at real sizes, bf16, and in CUDA graphs: tests/gpu/test_vision_attention.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from common.kernels import vision_attention as va  # noqa: E402
from common.vision import attention  # noqa: E402
from common.vision.attention import AttentionSpans  # noqa: E402

SMALL = va.Tiles(block_m=32, block_n=16, num_warps=4, num_stages=2)  # several blocks on small sequences

LAYOUTS = {
    "one": [0, 150],
    "uneven": [0, 5, 5, 70, 200],  # an empty span; lengths 5, 65, 130: none a multiple of a block
    "windows": [0, 16, 32, 48, 64, 76, 88],
}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds, scale: float) -> torch.Tensor:
    """softmax(q kᵀ * scale) v of each span alone, [N, heads, D]."""
    out = torch.zeros_like(q)
    for a, b in zip(bounds, bounds[1:], strict=False):
        if b > a:
            s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].double()) * scale
            out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:b].double()).to(q.dtype)
    return out


def qkv_views(tokens: int, heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as the towers get them from one qkv product: strided views of [tokens, 3, heads, D]."""
    qkv = torch.randn(tokens, 3, heads, head_dim, generator=torch.Generator().manual_seed(seed)) * 2
    return qkv.unbind(1)


@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("use_map", [True, False], ids=["map", "grid"])
def test_kernel_equals_the_reference(head_dim, layout, use_map):
    bounds = LAYOUTS[layout]
    q, k, v = qkv_views(bounds[-1], 2, head_dim, seed=head_dim)
    assert not q.is_contiguous()
    cu = torch.tensor(bounds, dtype=torch.int32)
    block_map = torch.from_numpy(va.make_block_map(bounds, SMALL.block_m)) if use_map else None
    max_len = int(np.diff(bounds).max())
    got = va.varlen_attention(q, k, v, cu, max_len, head_dim**-0.5, block_map=block_map, tiles=SMALL)
    want = reference(q, k, v, bounds, head_dim**-0.5)
    assert got.shape == q.shape and got.is_contiguous()
    assert (got - want).abs().max().item() < 5e-5


def test_default_tiles_on_a_sequence_longer_than_one_block():
    bounds = [0, 40, 200]
    q, k, v = qkv_views(bounds[-1], 1, 72, seed=1)
    cu = torch.tensor(bounds, dtype=torch.int32)
    tiles = va.tiles_for(72, va.block_m_for(160))
    assert (tiles.block_m, tiles.block_n) == (128, 64)
    block_map = torch.from_numpy(va.make_block_map(bounds, tiles.block_m))
    got = va.varlen_attention(q, k, v, cu, 160, 72**-0.5, block_map=block_map)
    assert (got - reference(q, k, v, bounds, 72**-0.5)).abs().max().item() < 5e-5


def test_block_map_and_head_dim_split():
    blocks = va.make_block_map([0, 5, 5, 70, 200], 32)
    assert blocks.dtype == np.int32
    assert blocks.tolist() == [[0, 0], [2, 0], [2, 32], [2, 64], [3, 0], [3, 32], [3, 64], [3, 96], [3, 128]]
    assert va.make_block_map([0, 0], 64).shape == (0, 2)
    assert va.head_dim_split(72) == (64, 16) and va.head_dim_split(80) == (64, 16)
    assert va.head_dim_split(64) == (64, 0) and va.head_dim_split(96) == (64, 32)
    assert va.head_dim_split(16) == (16, 0) and va.head_dim_split(40) == (32, 16)
    with pytest.raises(ValueError):
        va.head_dim_split(8)
    assert va.block_m_for(64) == 64 and va.block_m_for(65) == 128


def test_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(attention.ATTENTION_ENV, raising=False)
    assert attention.attention_kernel() == "sdpa"
    for value in ("triton", "auto", "SDPA"):
        monkeypatch.setenv(attention.ATTENTION_ENV, value)
        assert attention.attention_kernel() == value.lower()
    monkeypatch.setenv(attention.ATTENTION_ENV, "flash3")
    with pytest.raises(ValueError, match="flash3"):
        attention.attention_kernel()


@pytest.mark.parametrize("kernel", ["sdpa", "triton"])
def test_spans_carry_the_kernel_and_its_block_map(monkeypatch, kernel):
    monkeypatch.setenv(attention.ATTENTION_ENV, kernel)
    bounds = [0, 64, 64, 128, 300]
    spans = AttentionSpans.from_bounds(bounds, torch.device("cpu"), use_flash=True)
    assert spans.kernel == kernel and spans.max_seqlen == 172
    if kernel == "sdpa":
        assert spans.block_map is None
    else:
        assert spans.block_map.tolist() == va.make_block_map(bounds, 128).tolist()
    reference_spans = AttentionSpans.from_bounds(bounds, torch.device("cpu"), use_flash=False)
    assert reference_spans.kernel == "sdpa" and reference_spans.block_map is None


@pytest.mark.parametrize(("bounds", "uniform"), [
    ([0, 64, 128, 192], True),  # three spans of 64: one dense batch
    ([0, 100], True),  # one span
    ([0, 64, 128, 150], False),  # the longest length twice, one shorter span
    ([0, 22, 86], False),  # the longest once
    ([0, 64, 64, 128], False),  # an empty span among equal ones
    ([0], False),  # no span at all
])
@pytest.mark.parametrize("kernel", ["sdpa", "triton"])
def test_spans_are_uniform_only_when_all_have_the_longest_length(monkeypatch, bounds, uniform, kernel):
    """`uniform` (the dense one-batch path's condition) needs every span at the longest length: the dense
    call would read spans of another length as if they were one, across their bounds. The path is chosen
    on the host: the two kernels are stubbed (on a GPU, tests/gpu/test_vision_fast_path_gpu.py)."""
    spans = AttentionSpans.from_bounds(bounds, torch.device("cpu"), use_flash=True, kernel=kernel)
    assert spans.uniform is uniform
    if not bounds[-1]:
        return
    called = []
    monkeypatch.setattr(attention, "_dense_is_faster", lambda *args: True)
    monkeypatch.setattr(attention, "_dense", lambda q, *args: called.append("dense") or q)
    monkeypatch.setattr(attention, "_varlen", lambda q, *args, **kwargs: called.append("varlen") or q)
    q = torch.zeros(bounds[-1], 2, 8)
    spans._sdpa(q, q, q, 1.0)
    assert called == ["dense" if uniform else "varlen"]


def test_triton_spans_attend_like_the_reference_spans():
    bounds = [0, 64, 64, 128, 141]  # short spans: 64-row query blocks
    q, k, v = qkv_views(bounds[-1], 2, 80, seed=3)
    spans = AttentionSpans.from_bounds(bounds, torch.device("cpu"), use_flash=True, kernel="triton")
    assert spans.block_map.shape == (3, 2)
    got = spans.attend(q, k, v, 0.1)
    want = AttentionSpans.from_bounds(bounds, torch.device("cpu"), use_flash=False).attend(q, k, v, 0.1)
    assert (got - want).abs().max().item() < 5e-5


def tiny_tower(family: str):
    """(tower, grids, its module's name): a random 2-block tower of the family at its real head dim (Qwen3-VL
    72, Qwen2.5-VL 80), fp32 on the CPU, and two image grids for it."""
    torch.manual_seed(0)
    if family == "qwen3":
        from common.families.qwen3_vl.tower import Qwen3VisionTower

        tower = Qwen3VisionTower(dict(depth=2, hidden_size=144, intermediate_size=64, num_heads=2,
                                      num_position_embeddings=64, deepstack_visual_indexes=[0],
                                      out_hidden_size=32))
        return tower.eval(), [(1, 8, 12), (1, 4, 4)], "common.families.qwen3_vl.tower"
    from common.families.qwen2_5_vl.tower import QwenVisionTower

    tower = QwenVisionTower(dict(depth=2, hidden_size=160, intermediate_size=64, num_heads=2,
                                 fullatt_block_indexes=[1], window_size=56, out_hidden_size=32))
    return tower.eval(), [(1, 12, 8), (1, 4, 4)], "common.families.qwen2_5_vl.tower"


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5"])
def test_towers_with_the_triton_kernel_equal_the_reference(monkeypatch, family):
    """Both towers' plans take the switch: with the flash path forced on a CPU and MMSERVE_VISION_ATTENTION
    =triton, each attention layer runs the kernel (windows and full spans), and the outputs equal the
    reference path's."""
    tower, grids, module = tiny_tower(family)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), tower.patch_dim)
    with torch.no_grad():
        want = tower(pixels, grids)
        monkeypatch.setenv(attention.ATTENTION_ENV, "triton")
        monkeypatch.setattr(f"{module}.flash_supported", lambda *args: True)
        calls = []
        kernel = va.varlen_attention
        monkeypatch.setattr(va, "varlen_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
        got = tower(pixels, grids)
    assert len(calls) == len(tower.blocks)
    if family == "qwen3":
        got, want = torch.cat([got.merged, *got.deepstack]), torch.cat([want.merged, *want.deepstack])
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item() > 0.99999


# Compiled for sm_90 as varlen_attention launches it on contiguous [tokens, 16, head_dim] bf16 tensors.
_COMPILE = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from common.kernels import vision_attention as va

out = {}
for head_dim, block_m, use_map in json.loads(sys.argv[1]):
    tiles = va.tiles_for(head_dim, block_m)
    strides = [16 * head_dim, head_dim] * 4
    signature = {name: "*bf16" for name in ("Q", "K", "V", "Out")} | {"CU": "*i32", "MAP": "*i32"}
    for name in ("qt", "qh", "kt", "kh", "vt", "vh", "ot", "oh"):
        signature["stride_" + name] = "i32"
    signature |= {"qk_scale": "fp32", "blocks_per_seq": "i32"}
    constants = va.kernel_constants(head_dim, tiles, use_map, "tf32", va.stride_unit(strides))
    signature |= {name: "constexpr" for name in constants}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    kernel = triton.compile(ASTSource(va._varlen_attention_kernel, signature, constants, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    out[f"{head_dim}-{block_m}-{use_map}"] = {"ptx": kernel.asm["ptx"], "shared": kernel.metadata.shared}
print(json.dumps(out))
'''

HOPPER = [(72, 128, True), (80, 128, True), (80, 64, True), (72, 128, False)]


@pytest.fixture(scope="module")
def hopper() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(HOPPER)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", HOPPER, ids=lambda c: f"hd{c[0]}-m{c[1]}-{'map' if c[2] else 'grid'}")
def test_compiles_for_hopper_with_tensor_cores_and_wide_copies(hopper, case):
    kernel = hopper["{}-{}-{}".format(*case)]
    ptx = kernel["ptx"]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16", ptx)
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)  # 16-byte copies
    assert "ld.global.b16" not in ptx and "ld.global.u16" not in ptx  # no element-by-element loads
    assert kernel["shared"] <= 227 * 1024
