"""Forward flash attention over packed sequences (`cu_seqlens`), non-causal: the vision towers' attention
within images, frame groups and windows, at any head dim of at least 16 (Qwen3-VL's 72, Qwen2.5-VL's 80).

q, k, v are [tokens, heads, head_dim] (last dim contiguous; any token and head strides, so the q/k/v
views of one fused qkv product work); sequence i is rows [cu_seqlens[i], cu_seqlens[i+1]) and attends
only within itself. The output is a new contiguous [tokens, heads, head_dim] tensor of q's dtype.

The head dim runs as two power-of-two parts that `tl.dot` takes, since `tl.arange` spans powers of two
only: the first D_MAIN dims and a tail window of the last D_TAIL dims (72: dims 0-63 and 56-71, the
overlap zeroed in q and stored once; 80: 0-63 and 64-79); nothing is padded in memory. Softmax is online,
in fp32 (exp2 with log2(e) folded into the scale).

Every address the kernel forms, in every lane, is an element of its tensors, and no load has a mask: rows
past a span's end (a short span, the tensor's last rows) read the span's last row again and are masked
in the scores and the stores, also in the key blocks a pipelined loop loads ahead past its end; the tail
window never reaches past the head dim. So no result depends on a masked load's fill or on memory outside
the tensors (tests/common/test_vision_attention_bounds.py watches every address in the interpreter).

Programs: (query block, head). A query block is BLOCK_M rows of one sequence; `block_map` lists them
as (sequence, first row within it), made on the host from the bounds once per layout (`make_block_map`),
so a launch has no host sync and can be captured in a CUDA graph. Without a map the grid is
ceil(max_seqlen / BLOCK_M) blocks per sequence and the spare ones stop at once (`max_seqlen` is passed
in, never read from the device).

Imports nothing from the project (torch and triton only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Tiles:
    """A launch's tile shape: query rows and key rows per step, warps and pipeline stages."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


# Spans at most this long (Qwen2.5-VL's windows: 64 patches) take 64-row query blocks, longer ones 128.
SHORT_SPAN = 64


def block_m_for(max_seqlen: int) -> int:
    """Query rows per program for spans of at most max_seqlen rows."""
    return 64 if max_seqlen <= SHORT_SPAN else 128


def tiles_for(head_dim: int, block_m: int) -> Tiles:
    """The fixed tile table (Hopper), keyed by head dim and query block; bench/vision_attention.py sweeps
    the alternatives on the device."""
    if block_m == 64:
        return Tiles(64, 64, 4, 3)
    if head_dim <= 128:
        return Tiles(128, 64, 8, 3)
    return Tiles(128, 32, 8, 2)


def make_block_map(cu_seqlens: np.ndarray | list[int], block_m: int) -> np.ndarray:
    """[blocks, 2] int32 (sequence, first query row within it) of every query block of BLOCK_M rows, over
    the host bounds `cu_seqlens`; empty sequences have none."""
    lengths = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    per_seq = -(-lengths // block_m)
    seqs = np.repeat(np.arange(len(lengths)), per_seq)
    firsts = (np.arange(len(seqs)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * block_m
    return np.stack([seqs, firsts], axis=1).astype(np.int32).reshape(-1, 2)


def head_dim_split(head_dim: int) -> tuple[int, int]:
    """(main, tail): the power-of-two leading part of the head dim and the power-of-two width (at least
    16; 0: none) of the window over its last dims that covers the rest. 72 -> (64, 16), 80 -> (64, 16)."""
    if head_dim < 16:
        raise ValueError(f"head dim {head_dim} < 16 is not supported")
    main = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - main
    return main, (0 if rest == 0 else max(16, triton.next_power_of_2(rest)))


def stride_unit(strides: list[int]) -> int:
    """The largest power of two, at most 16, dividing every stride (the kernel's UNIT)."""
    unit = math.gcd(16, *strides)
    return unit & -unit


@triton.jit
def _kv_block(acc0, acc1, m_i, l_i, q0, q1, k_seq, v_seq, stride_kt, stride_vt, start_n, length, qk_scale,
              D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, TAIL_FIRST: tl.constexpr, BLOCK_N: tl.constexpr,
              PARTIAL: tl.constexpr, PRECISION: tl.constexpr):
    """One block of BLOCK_N keys folded into the running softmax (m_i, l_i, in log2 units) and outputs
    (acc0: the main dims, acc1: the tail window). Rows past the span read its last row again, and in the
    PARTIAL (last) block their scores are masked: no load has a mask, and no address leaves the span, also
    in the blocks past the loop's end that a pipelined loop prefetches."""
    rows = start_n + tl.arange(0, BLOCK_N)
    if PARTIAL:
        n_ok = rows < length
    rows = tl.minimum(rows, length - 1).to(tl.int64)
    offs_d0 = tl.arange(0, D_MAIN)
    k0 = tl.load(k_seq + rows[:, None] * stride_kt + offs_d0[None, :])
    s = tl.dot(q0, tl.trans(k0), input_precision=PRECISION)
    if D_TAIL > 0:
        offs_d1 = TAIL_FIRST + tl.arange(0, D_TAIL)
        k1 = tl.load(k_seq + rows[:, None] * stride_kt + offs_d1[None, :])
        s = tl.dot(q1, tl.trans(k1), s, input_precision=PRECISION)  # q1 is 0 on dims the main part has
    if PARTIAL:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # finite: m_i starts at -1e30, not -inf
    p = tl.math.exp2(s * qk_scale - m_new[:, None])  # one FMA a score; a masked key gives exp2(-inf) = 0
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v0 = tl.load(v_seq + rows[:, None] * stride_vt + offs_d0[None, :])
    p = p.to(v0.dtype)
    acc0 = tl.dot(p, v0, acc0 * alpha[:, None], input_precision=PRECISION)
    if D_TAIL > 0:
        v1 = tl.load(v_seq + rows[:, None] * stride_vt + offs_d1[None, :])
        acc1 = tl.dot(p, v1, acc1 * alpha[:, None], input_precision=PRECISION)
    return acc0, acc1, m_new, l_i


@triton.jit
def _varlen_attention_kernel(
    Q, K, V, Out, CU, MAP,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale, blocks_per_seq,
    D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, TAIL_FIRST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_MAP: tl.constexpr, PRECISION: tl.constexpr,
    UNIT: tl.constexpr,
):
    # The strides come divided by UNIT, a power of two dividing all of them: multiplied back here, the
    # compiler knows every row's address is a multiple of UNIT elements and vectorizes the loads (a head
    # stride of 72 is not a multiple of 16, the only divisibility Triton infers from an integer argument).
    stride_qt, stride_qh = stride_qt * UNIT, stride_qh * UNIT
    stride_kt, stride_kh = stride_kt * UNIT, stride_kh * UNIT
    stride_vt, stride_vh = stride_vt * UNIT, stride_vh * UNIT
    stride_ot, stride_oh = stride_ot * UNIT, stride_oh * UNIT
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    if USE_MAP:
        seq = tl.load(MAP + 2 * pid)
        q_first = tl.load(MAP + 2 * pid + 1)
    else:
        seq = pid // blocks_per_seq
        q_first = (pid % blocks_per_seq) * BLOCK_M
    begin = tl.load(CU + seq)
    length = tl.load(CU + seq + 1) - begin
    if q_first >= length:  # the grid without a map is an upper bound: spare programs stop here
        return
    begin = begin.to(tl.int64)

    # Query rows past the span read its last row again (finite, inside the tensor) and are never stored.
    offs_m = q_first + tl.arange(0, BLOCK_M)
    m_ok = offs_m < length
    q_rows = begin + tl.minimum(offs_m, length - 1).to(tl.int64)
    offs_d0 = tl.arange(0, D_MAIN)
    q_head = Q + head * stride_qh
    q0 = tl.load(q_head + q_rows[:, None] * stride_qt + offs_d0[None, :])
    acc0 = tl.zeros([BLOCK_M, D_MAIN], dtype=tl.float32)
    if D_TAIL > 0:
        # The tail window is the head's last D_TAIL dims, inside it; where it overlaps the main part
        # (TAIL_FIRST < D_MAIN), q1 is 0 so those dims count once in the scores.
        offs_d1 = TAIL_FIRST + tl.arange(0, D_TAIL)
        q1 = tl.load(q_head + q_rows[:, None] * stride_qt + offs_d1[None, :])
        if TAIL_FIRST < D_MAIN:
            q1 = tl.where(offs_d1[None, :] >= D_MAIN, q1, tl.zeros_like(q1))
        acc1 = tl.zeros([BLOCK_M, D_TAIL], dtype=tl.float32)
    else:  # unused placeholders (the helper's tail steps are compiled out)
        q1 = q0
        acc1 = acc0
    # A finite start: a row whose first block had no valid key would give exp2(-inf - -inf) = NaN.
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    k_seq = K + begin * stride_kt + head * stride_kh
    v_seq = V + begin * stride_vt + head * stride_vh
    n_full = (length // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        acc0, acc1, m_i, l_i = _kv_block(acc0, acc1, m_i, l_i, q0, q1, k_seq, v_seq, stride_kt, stride_vt,
                                         start_n, length, qk_scale, D_MAIN, D_TAIL, TAIL_FIRST, BLOCK_N,
                                         False, PRECISION)
    if n_full < length:  # the last, partial key block
        acc0, acc1, m_i, l_i = _kv_block(acc0, acc1, m_i, l_i, q0, q1, k_seq, v_seq, stride_kt, stride_vt,
                                         n_full, length, qk_scale, D_MAIN, D_TAIL, TAIL_FIRST, BLOCK_N,
                                         True, PRECISION)

    inv_l = 1.0 / l_i  # >= 1 term: every query row is a real row of a span of at least one key
    o_rows = Out + head * stride_oh + q_rows[:, None] * stride_ot
    tl.store(o_rows + offs_d0[None, :], (acc0 * inv_l[:, None]).to(Out.dtype.element_ty), mask=m_ok[:, None])
    if D_TAIL > 0:
        o_tail = (acc1 * inv_l[:, None]).to(Out.dtype.element_ty)
        if TAIL_FIRST < D_MAIN:  # the overlap was stored from acc0
            tl.store(o_rows + offs_d1[None, :], o_tail, mask=m_ok[:, None] & (offs_d1[None, :] >= D_MAIN))
        else:
            tl.store(o_rows + offs_d1[None, :], o_tail, mask=m_ok[:, None])


def kernel_constants(head_dim: int, tiles: Tiles, use_map: bool, precision: str, unit: int) -> dict:
    """The kernel's compile-time arguments for a launch (the offline compile test uses them too)."""
    main, tail = head_dim_split(head_dim)
    return dict(D_MAIN=main, D_TAIL=tail, TAIL_FIRST=head_dim - tail if tail else main, BLOCK_M=tiles.block_m,
                BLOCK_N=tiles.block_n, USE_MAP=use_map, PRECISION=precision, UNIT=unit)


_LOG2E = 1.4426950408889634


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float, block_map: torch.Tensor | None = None,
                     tiles: Tiles | None = None) -> torch.Tensor:
    """softmax(q kᵀ * scale) v within each sequence [cu_seqlens[i], cu_seqlens[i+1]).

    q, k, v: [tokens, heads, head_dim] of one dtype, last dim contiguous; cu_seqlens: int32 on q's
    device; max_seqlen: the longest sequence (host int); block_map: `make_block_map(bounds,
    tiles.block_m)` on the device, or None (a grid of ceil(max_seqlen / block_m) blocks per sequence);
    tiles: default `tiles_for(head_dim, block_m_for(max_seqlen))`. Returns [tokens, heads, head_dim]."""
    tokens, heads, head_dim = q.shape
    max_seqlen = int(max_seqlen)
    if k.shape != q.shape or v.shape != q.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v differ: {tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}, "
                         f"{tuple(v.shape)} {v.dtype}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    head_dim_split(head_dim)  # refuses a head dim under 16 before anything is allocated
    if tiles is None:
        tiles = tiles_for(head_dim, block_m_for(max_seqlen))
    out = torch.empty((tokens, heads, head_dim), device=q.device, dtype=q.dtype)
    if tokens == 0 or max_seqlen == 0:
        return out
    if block_map is not None:
        blocks, per_seq, table = block_map.shape[0], 1, block_map
    else:
        per_seq = triton.cdiv(max_seqlen, tiles.block_m)
        blocks, table = (cu_seqlens.shape[0] - 1) * per_seq, cu_seqlens  # MAP unused
    if blocks == 0:
        return out
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    strides = [t.stride(d) for t in (q, k, v, out) for d in (0, 1)]
    unit = stride_unit(strides)
    _varlen_attention_kernel[(blocks, heads)](
        q, k, v, out, cu_seqlens, table, *(stride // unit for stride in strides),
        float(scale) * _LOG2E, per_seq,
        **kernel_constants(head_dim, tiles, block_map is not None, precision, unit),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
