"""A batch-invariant matrix product: row i of x @ w is the same bits whatever the other rows are.

cuBLAS picks its kernel, its tiles and its split of K by the shape, so one row's products sum in another
order when the batch grows (a decode step of 1 row against one of 40, a prompt in one chunk against two).
This kernel never changes with M: one configuration per (N, K, dtype, SM count) (`invariant_tiles`), and
M kept out of the compiled specialisations (`do_not_specialize`), so the compiled code is one for every
batch. An element's sum is then fixed: K is cut into SPLIT_K ranges of whole BLOCK_K blocks at fixed
offsets; each range is summed block after block in order into an fp32 partial; the partials go to an fp32
workspace [SPLIT_K, M, N] and the last of a tile's programs to arrive (a per-tile counter) adds them in
split order 0, 1, 2, ... (never atomics on the values), adds the bias and rounds once to the output dtype.
Which program arrives last, the grid's order and the number of row tiles change with M; none changes a sum.

The split lets a narrow weight fill the GPU at decode: a one-row product of a 4096-wide weight is only
N / BLOCK_N tiles, so SPLIT_K multiplies its programs to about twice the SM count (each streams its slice
of the weight once). The price is the partials' round trip at large M, where the grid puts a tile's
splits next to each other so that their partials are still in L2 when the last one adds them.

The tile counters are a kept zeroed buffer per device that the kernel leaves zeroed (like
fp8_split_k.py's): the products of one stream run one after another, so they never share a counter at
the same time (two streams of invariant products on one device at once would not be safe).

MMSERVE_INVARIANT_TILES replaces the 16-bit tile shape for a process (`_tile_shapes`): the A/B of whole
runs; bench.invariant_matmul times the product against torch's by rows, `--sweep` over candidate shapes.
MMSERVE_INVARIANT_SPLIT_K=0 sums all of K in one program per tile (no workspace, no counters): the kernel
as it was before the split, for an A/B or where the split misbehaves (read once, at import).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.kernels.pdl import launch_options, release_dependents, wait_for_inputs

# Triton's interpreter (CPU tests) computes tl.dot with numpy, which reads bf16 as integers, and rounds
# fp32 to bf16 by truncation: there the kernel widens its operands to fp32 and rounds to nearest even
# itself. On a GPU neither line exists.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

MIN_BLOCKS_PER_SPLIT = 4  # a split streams at least this many K blocks: shorter ones mostly fill a pipeline
MAX_SPLIT_K = 16  # the most ranges asked for (evening their lengths may add a few)
PROGRAMS_PER_SM = 2  # the grid a one-row-tile product aims for: this many programs per SM
GROUP_M = 8  # row tiles that take a column of tiles together (L2 reuse of the weight tile at large M)


@dataclass(frozen=True)
class InvariantTiles:
    """The one configuration a (N, K, dtype) product takes on a device, whatever M is: tile sizes, the
    number of K ranges (`split_k`, each `k_span` long, whole `block_k` blocks) and the launch's warps and
    pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    k_span: int = 0  # 0: all of K (split_k 1)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if self.split_k < 1 or (self.split_k > 1 and self.k_span % self.block_k):
            raise ValueError(f"a split of K is whole blocks of {self.block_k}, got {self}")


ENV = "MMSERVE_INVARIANT_TILES"


def _tile_shapes(spec: str | None) -> dict[int, tuple[int, int, int, int, int]]:
    """(block_m, block_n, block_k, num_warps, num_stages) per operand width in bytes. 16-row tiles: a
    one-row decode step computes 16 rows, not 64; 128-deep steps of the weight (256 contiguous bytes of
    each of its rows in bf16); fp32 takes 32-deep steps (its dot is the FMA one, input_precision="ieee").
    `spec` ("BMxBNxBK/warps/stages", from MMSERVE_INVARIANT_TILES) replaces the 16-bit one: an A/B of
    whole runs (bench.invariant_matmul --sweep times the candidates); read once, at import, so that every
    product of a process takes the same."""
    shapes = {2: (16, 64, 128, 4, 4), 4: (16, 64, 32, 4, 3)}
    if spec:
        try:
            blocks, warps, stages = spec.split("/")
            bm, bn, bk = (int(v) for v in blocks.lower().split("x"))
            shapes[2] = (bm, bn, bk, int(warps), int(stages))
        except ValueError:
            raise ValueError(f"{ENV} is BMxBNxBK/warps/stages (e.g. 64x64x128/4/3), not {spec!r}") from None
    return shapes


TILE_SHAPES = _tile_shapes(os.environ.get(ENV))
SPLIT_ENV = "MMSERVE_INVARIANT_SPLIT_K"
SPLIT_K_ON = os.environ.get(SPLIT_ENV, "1") != "0"


def split_of_k(n: int, k: int, block_n: int, block_k: int, sms: int) -> tuple[int, int]:
    """(split_k, k_span) for an [n, k] weight: K ranges of equal whole numbers of blocks (the last may be
    shorter, never empty), at least as many as make one row tile's programs PROGRAMS_PER_SM x sms, as far
    as ranges of MIN_BLOCKS_PER_SPLIT blocks and MAX_SPLIT_K ranges allow."""
    k_blocks = triton.cdiv(k, block_k)
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, triton.cdiv(n, block_n))
    target = max(1, min(wanted, k_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLIT_K))
    blocks_per_split = triton.cdiv(k_blocks, target)
    while triton.cdiv(k_blocks, blocks_per_split) < target:  # equal ranges can fall short: shorten them
        blocks_per_split -= 1
    split = triton.cdiv(k_blocks, blocks_per_split)
    return split, (blocks_per_split * block_k if split > 1 else 0)


@functools.cache
def invariant_tiles(n: int, k: int, dtype: torch.dtype, sms: int) -> InvariantTiles:
    """The configuration of a product by an [k, n] matrix of `dtype` on a device of `sms` multiprocessors.
    Never a function of M: that is the whole contract (module docstring)."""
    block_m, block_n, block_k, warps, stages = TILE_SHAPES[4 if dtype == torch.float32 else 2]
    split, span = split_of_k(n, k, block_n, block_k, sms) if SPLIT_K_ON else (1, 0)
    return InvariantTiles(block_m, block_n, block_k, split, span, warps, stages)


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def device_sms(device: torch.device) -> int:
    """The SM count a product on `device` is configured for (132, an H100's, on the CPU: the
    interpreter's tests see the GPU's configurations)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def _to_output(acc, bias_ptr, cols, col_ok, out_ptrs, out_mask, HAS_BIAS: tl.constexpr):
    # Once per output element, after all of K: the bias, one rounding to the output dtype.
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if _INTERPRETED and out_ptrs.dtype.element_ty == tl.bfloat16:  # nearest even (the interpreter truncates)
        bits = acc.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = tl.where(acc == acc, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), acc.to(tl.bfloat16))
    else:
        out = acc.to(out_ptrs.dtype.element_ty)
    tl.store(out_ptrs, out, mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, ws_ptr, cnt_ptr, M, N, K, k_span,
                             stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                             HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                             GROUP_M: tl.constexpr):
    # Programs: a tile's K splits next to each other (their partials meet in L2), then the tiles grouped
    # GROUP_M row tiles to a column of tiles (consecutive programs share a weight tile). Only the order of
    # work depends on M, never what is summed nor in which order.
    wait_for_inputs()
    pid = tl.program_id(0)
    split = pid % SPLIT_K
    tile = pid // SPLIT_K
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    group = tile // (GROUP_M * n_tiles)
    first_m = group * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * n_tiles)) % group_rows
    pid_n = (tile % (GROUP_M * n_tiles)) // group_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        k_lo = split * k_span
        k_hi = tl.minimum(k_lo + k_span, K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + (k_lo + ks)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_lo + ks)[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # this split's K blocks, in order
        k_ok = (k0 + ks) < k_hi
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if _INTERPRETED:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    release_dependents()
    out_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        _to_output(acc, bias_ptr, cols, col_ok, out_ptrs, out_mask, HAS_BIAS)
    else:
        plane = M.to(tl.int64) * N  # one split's partials
        part_ptrs = ws_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(part_ptrs + split * plane, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial written before the counter says so
        last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        if last:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(SPLIT_K):  # split order 0, 1, 2, ...: the one order of the sum
                total += tl.load(part_ptrs + i * plane, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
            _to_output(total, bias_ptr, cols, col_ok, out_ptrs, out_mask, HAS_BIAS)


KEPT_COUNTERS = 1 << 16  # tiles a kept counter buffer holds (256 KiB; decode's products need far fewer)
_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, that the kernel leaves zeroed again (module docstring:
    one stream of products per device at a time). One kept buffer per device, made outside graph capture
    and never replaced (a captured graph keeps its address); a product of more tiles (thousands of rows)
    or one under capture before the buffer exists gets zeroed counters of its own (under capture a node
    of the graph: a kept buffer made then would not be zeroed until a replay)."""
    buf = _counters.get(device)
    if buf is not None and tiles <= KEPT_COUNTERS:
        return buf
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if tiles > KEPT_COUNTERS or capturing:
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    buf = _counters[device] = torch.zeros(KEPT_COUNTERS, dtype=torch.int32, device=device)
    return buf


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, tiles: InvariantTiles | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) in a's dtype, fp32 sums; any strides. Row i of the result depends
    on row i of `a`, b and bias only, never on M or the other rows. `out` [M, N] receives it, in a's dtype
    or in fp32 (the sums before their rounding). `tiles` replaces the configuration `invariant_tiles`
    gives (tests, benchmarks): a caller that passes one must pass the same for every M."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"invariant_matmul takes [M, K] @ [K, N], got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"invariant_matmul takes one dtype, got {a.dtype} and {b.dtype}")
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty(m, n, dtype=a.dtype, device=a.device) if out is None else out
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
    tiles = tiles or invariant_tiles(n, k, a.dtype, device_sms(a.device))
    m_tiles, n_tiles = triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n)
    split = tiles.split_k
    if split > 1 and triton.cdiv(k, tiles.k_span) != split:
        raise ValueError(f"{split} splits of {tiles.k_span} do not cover K = {k} with none empty")
    # fp32 partials [split, m, n] and the tiles' arrival counters, only where K is split (else stand-ins)
    ws, counters = a, a
    if split > 1:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=a.device)
        counters = _tile_counters(a.device, m_tiles * n_tiles)
    _invariant_matmul_kernel[(split * m_tiles * n_tiles,)](
        a, b, bias if bias is not None else a, out, ws, counters, m, n, k, tiles.k_span, a.stride(0),
        a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
        IEEE=a.dtype == torch.float32, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        SPLIT_K=split, GROUP_M=GROUP_M, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **launch_options())
    return out
