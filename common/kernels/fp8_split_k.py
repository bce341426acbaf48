"""FP8 weight products at 2..64 rows (decode with several streams): the split-K kernel and its stream-K form.

`_split_k_kernel`. Programs over (N blocks, K splits, M blocks): a 4096 x 4096 weight is only 32-128 N
blocks, too few programs for 132 SMs, so K is cut into SPLIT_K ranges and each program streams a BLOCK_N x
K / SPLIT_K slice, widening FP8 to the activation dtype in registers for the tensor cores (fp32
accumulation), or, in its SWAP_AB configurations, computing the transpose W @ x^T in fp16 (the weight tile
as wgmma's 64-row side, from registers; FP8 -> fp16 is one conversion per two weights where FP8 -> bf16
takes three). Partials go to an fp32 workspace [SPLIT_K, M, N]; per output tile a counter counts the
arrivals and the last program sums the partials in split order (deterministic: the same bits every call,
whatever order the programs ran in), then applies the per-channel scale and the bias once and resets the
counter. SPLIT_K = 1 (no workspace) stays a config for wide matrices. Block-scaled weights whose blocks span
a multiple of 128 columns take it too (a K range is whole BLOCK_K blocks, so the scale is applied per K
block in the loop).

The same kernel has a stream-K form (`PROGRAMS_PER_SM` > 0): a grid sized to the GPU, each program
streaming an equal run of the (N block, K block) sequence with one pipelined loop across output tiles, the
tiles its run cuts summed like split-K's partials (split-K's programs each fill and drain their load
pipeline, a fixed 7-12 us a product measured at 32 rows).

Autotuned per (rows bucket, matrix) among `SPLIT_K_SHAPES` and `STREAM_K_SHAPES`, pruned to the splits a
matrix needs (MMSERVE_FP8_STREAM_K picks the forms offered). Graph-capture safe: the workspace comes from
the caching allocator and the counters are a kept zeroed buffer the kernel leaves zeroed (one stream of
split-K products per device at a time: see `_tile_counters`). fp8_linear.py routes products here.

Only imported on GPU paths or under TRITON_INTERPRET=1: the CPU tests (tests/quant/test_split_k_fp8.py)
run both forms in Triton's interpreter, whose scalar conversion tests/conftest.py patches for numpy >= 2.4
(loops bounded by kernel arguments fail without it), in fp16 (the interpreter's bf16 tl.dot is wrong);
tests/gpu/test_fp8_gpu.py runs every config.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
import triton.testing

from common.kernels.fp8_layout import ScaleBlock
from common.kernels.pdl import launch_options, release_dependents, wait_for_inputs

# The FP8 autotuners' timing and shape key (fp8_linear.py's too). 2 + 10 ms per configuration picked poor
# ones on a fresh H200 (timing noise); 10 + 40 ms did not.
BRIEF_TIMING = functools.partial(triton.testing.do_bench, warmup=10, rep=40)
# Every FP8 autotuner keeps its timings in Triton's cache directory (keyed by Triton, the GPU target, the
# kernel's source and the shape key), so a decoder restarted on the same host skips them: at start-up the
# split-K kernel alone is timed for ~13 configs x 4 matrices x 3 row buckets, ~50 ms each.
TUNING = dict(do_bench=BRIEF_TIMING, cache_results=True)
KEY = ["M_BUCKET", "N", "K", "PER_CHANNEL", "SCALE_ROWS", "SCALE_COLS"]


# bf16 values beyond this saturate when the swapped product takes activations as fp16 (65504 is not a
# bf16 value; 65280 is the largest bf16 that fp16 holds).
FP16_LIMIT = tl.constexpr(65280.0)
# The most programs that share one output tile in the stream-K form (its partials' workspace depth):
# `stream_k_programs` keeps the grid small enough for it.
MAX_STREAM_PARTS = tl.constexpr(8)


@triton.jit
def _k_block(acc, x_ptr, w_ptr, s_ptr, rm, rn, rk, m_mask, n_mask, k0, K, stride_xm, stride_wn, stride_sn,
             stride_sk, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, PER_CHANNEL: tl.constexpr,
             SWAP_AB: tl.constexpr = False):
    # acc += x[rm, k0:k0+BLOCK_K] @ (w[rn, k0:k0+BLOCK_K] * block scales)^T in fp32 [BLOCK_M, BLOCK_N]; a
    # block-scaled weight's scale per K block (BLOCK_K divides SCALE_COLS; per channel: the caller's, at
    # the end).
    # SWAP_AB: acc is the transpose [BLOCK_N, BLOCK_M], computed as W @ x^T in fp16: the weight tile is the
    # MMA's tall side (wgmma's 64-row A operand, taken from registers, so the widened tile never goes back
    # to shared memory) and the few activation rows its narrow side. FP8 -> fp16 is one packed conversion
    # per two weights where FP8 -> bf16 goes through fp32 (three per two, on a pipe of 16 per clock per SM).
    # On the H200 that was not the limit (bandwidth within 10-15% either way); the swapped configs win at
    # 32-64 rows of some shapes (BENCHMARKS.md). tests/quant/test_split_k_fp8.py holds both to the
    # reference. Activations beyond FP16_LIMIT saturate there.
    k_mask = (k0 + rk) < K
    if SWAP_AB:
        x = tl.load(x_ptr + rm[None, :].to(tl.int64) * stride_xm + (k0 + rk)[:, None],
                    mask=k_mask[:, None] & m_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        x16 = tl.clamp(x.to(tl.float32), -FP16_LIMIT, FP16_LIMIT).to(tl.float16)
        part = tl.dot(w.to(tl.float16), x16)
        if PER_CHANNEL:
            acc += part
        else:
            s = tl.load(s_ptr + (rn // SCALE_ROWS) * stride_sn + (k0 // SCALE_COLS) * stride_sk,
                        mask=n_mask & (k0 < K), other=0.0)
            acc += part * s[:, None]
    else:
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        part = tl.dot(x, w.to(x.dtype))
        if PER_CHANNEL:
            acc += part
        else:
            s = tl.load(s_ptr + (rn // SCALE_ROWS) * stride_sn + (k0 // SCALE_COLS) * stride_sk,
                        mask=n_mask & (k0 < K), other=0.0)
            acc += part * s[None, :]
    return acc


@triton.jit
def k_range_product(x_ptr, w_ptr, s_ptr, rm, rn, rk, m_mask, n_mask, k_lo, k_hi, K, stride_xm, stride_wn,
                     stride_sn, stride_sk, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                     PER_CHANNEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr = False):
    # x[rm, k_lo:k_hi] @ (w[rn, k_lo:k_hi] * block scales)^T in fp32 [BLOCK_M, BLOCK_N] (`_k_block`); also
    # fp8_linear's one-pass kernel.
    if SWAP_AB:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            acc_t = _k_block(acc_t, x_ptr, w_ptr, s_ptr, rm, rn, rk, m_mask, n_mask, k0, K, stride_xm,
                             stride_wn, stride_sn, stride_sk, SCALE_ROWS, SCALE_COLS, PER_CHANNEL, True)
        return tl.trans(acc_t)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        acc = _k_block(acc, x_ptr, w_ptr, s_ptr, rm, rn, rk, m_mask, n_mask, k0, K, stride_xm, stride_wn,
                       stride_sn, stride_sk, SCALE_ROWS, SCALE_COLS, PER_CHANNEL, False)
    return acc


@triton.jit
def _epilogue(acc, rn, n_mask, out_ptrs, out_mask, s_ptr, b_ptr, stride_sn, PER_CHANNEL: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    # Once per output tile, after all of K: the per-channel scale, the bias, one rounding to x's dtype.
    if PER_CHANNEL:
        acc = acc * tl.load(s_ptr + rn * stride_sn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_partials(acc, part, parts, ws_ptr, cnt_ptr, tile, rm, rn, n_mask, out_ptrs, out_mask, s_ptr, b_ptr,
                  M, N, stride_sn, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                  MAX_PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  THREADS: tl.constexpr = 0):
    # One of an output tile's `parts` partial products (K ranges), number `part`: written to ws
    # [MAX_PARTS, M, N] and counted in the tile's counter; the program that arrives last adds the
    # partials in part order 0, 1, ... (the same sum whatever order the programs ran in: deterministic),
    # applies the scale and bias, stores the output and sets the counter back to 0 for the next call.
    # Every thread's partial must be written before the counter says so. THREADS = 0: a CTA barrier, then
    # one atomic (release). THREADS = the program's thread count: each thread bumps the counter itself,
    # after its own stores (release), and the program that brings it to parts * THREADS is the last; no
    # barrier, which inside a loop would stop Triton's pipeliner from multi-buffering the loop's loads.
    part_ptrs = ws_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(part_ptrs + part.to(tl.int64) * M * N, acc, mask=out_mask)
    if THREADS == 0:
        tl.debug_barrier()
        last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == parts - 1
    else:
        one_each = tl.arange(0, THREADS) * 0  # THREADS elements: one per thread
        seen = tl.atomic_add(cnt_ptr + tile + one_each, 1, sem="acq_rel", scope="gpu")
        last = tl.max((seen == parts * THREADS - 1).to(tl.int32), axis=0) == 1
    if last:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in tl.static_range(MAX_PARTS):  # fixed order: bit-identical results call after call
            total += tl.load(part_ptrs + i * M * N, mask=out_mask & (i < parts), other=0.0,
                             cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + tile, 0)
        _epilogue(total, rn, n_mask, out_ptrs, out_mask, s_ptr, b_ptr, stride_sn, PER_CHANNEL, HAS_BIAS)


@triton.jit
def _stream_k_product(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                      stride_xm, stride_wn, stride_sn, stride_sk, stride_om,
                      SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, PER_CHANNEL: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, THREADS: tl.constexpr):
    # Stream-K: the N blocks' K blocks in a row (block n's K blocks 0..k_tiles-1, then block n+1's) are
    # dealt out in equal consecutive runs, one per program of a grid sized to the GPU, so every program
    # streams the same number of weight tiles and its load pipeline runs on across output tiles instead
    # of filling and draining once per (N block, K split) program. A run cuts its first and last tiles'
    # K ranges anywhere: the programs sharing a tile (consecutive ones, at most MAX_STREAM_PARTS, which
    # the launch guarantees) finish it through `_sum_partials`, numbered by program in K order; a program
    # holding a whole tile stores it at once. One loop over the run, the tile's end handled inside it (the
    # persistent GEMM's form that Triton's pipeliner keeps multi-buffered).
    pid = tl.program_id(0)
    pid_m = tl.program_id(2)
    n_blocks = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    run = tl.cdiv(n_blocks * k_tiles, tl.num_programs(0))
    first = pid * run
    last = tl.minimum(first + run, n_blocks * k_tiles)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(first, last):
        n_block = it // k_tiles
        k_block = it - n_block * k_tiles
        rn = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        acc = _k_block(acc, x_ptr, w_ptr, s_ptr, rm, rn, rk, m_mask, n_mask, k_block * BLOCK_K, K, stride_xm,
                       stride_wn, stride_sn, stride_sk, SCALE_ROWS, SCALE_COLS, PER_CHANNEL, SWAP_AB)
        if (k_block == k_tiles - 1) | (it == last - 1):  # this program's part of the tile ends here
            if SWAP_AB:
                done = tl.trans(acc)
            else:
                done = acc
            out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
            out_mask = m_mask[:, None] & n_mask[None, :]
            # The programs whose runs meet this tile: the one holding its first K block to the one
            # holding its last.
            holder = (n_block * k_tiles) // run
            parts = ((n_block + 1) * k_tiles - 1) // run - holder + 1
            if parts == 1:
                _epilogue(done, rn, n_mask, out_ptrs, out_mask, s_ptr, b_ptr, stride_sn, PER_CHANNEL,
                          HAS_BIAS)
            else:
                _sum_partials(done, pid - holder, parts, ws_ptr, cnt_ptr, pid_m * n_blocks + n_block, rm, rn,
                              n_mask, out_ptrs, out_mask, s_ptr, b_ptr, M, N, stride_sn, PER_CHANNEL,
                              HAS_BIAS, MAX_STREAM_PARTS, BLOCK_M, BLOCK_N, THREADS)
            acc = tl.zeros_like(acc)
    release_dependents()


@triton.jit
def _split_k_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K,
                    stride_xm, stride_wn, stride_sn, stride_sk, stride_om,
                    SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, PER_CHANNEL: tl.constexpr,
                    HAS_BIAS: tl.constexpr, M_BUCKET: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                    SWAP_AB: tl.constexpr = False, PROGRAMS_PER_SM: tl.constexpr = 0,
                    THREADS: tl.constexpr = 128):
    # Programs over (N blocks, K splits, M blocks): at decode a 4096 x 4096 weight is 32-128 N blocks,
    # too few to keep 132 SMs' worth of loads in flight, so K is cut into SPLIT_K ranges (whole BLOCK_K
    # blocks, so a block-scaled weight's scale column never changes inside one) and every program streams
    # its BLOCK_N x (K / SPLIT_K) slice once; with SPLIT_K > 1 the tile's last program adds the partials
    # (`_sum_partials`). PROGRAMS_PER_SM > 0 is the stream-K form instead (`_stream_k_product`, a grid of
    # (that many x SMs, 1, M blocks) programs of THREADS = 32 x num_warps threads; SPLIT_K unused).
    # Launched early (pdl.py): the launch and the programs' set-up overlap the kernel before; nothing is
    # read before the wait (the loop loads weights and activations together).
    wait_for_inputs()
    if PROGRAMS_PER_SM > 0:
        _stream_k_product(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn,
                          stride_sn, stride_sk, stride_om, SCALE_ROWS, SCALE_COLS, PER_CHANNEL, HAS_BIAS,
                          BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, THREADS)
    else:
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        n_mask = rn < N
        k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_span
        acc = k_range_product(x_ptr, w_ptr, s_ptr, rm, rn, rk, m_mask, n_mask, k_lo, k_lo + k_span, K,
                               stride_xm, stride_wn, stride_sn, stride_sk, SCALE_ROWS, SCALE_COLS,
                               PER_CHANNEL, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB)
        release_dependents()  # the next kernel may launch and wait behind the partials' sum
        out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        out_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            _epilogue(acc, rn, n_mask, out_ptrs, out_mask, s_ptr, b_ptr, stride_sn, PER_CHANNEL, HAS_BIAS)
        else:
            _sum_partials(acc, pid_k, SPLIT_K, ws_ptr, cnt_ptr, pid_m * tl.num_programs(0) + pid_n, rm, rn,
                          n_mask, out_ptrs, out_mask, s_ptr, b_ptr, M, N, stride_sn, PER_CHANNEL, HAS_BIAS,
                          SPLIT_K, BLOCK_M, BLOCK_N)


# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, SWAP_AB). Small BLOCK_K and few stages keep a CTA's
# shared memory (BLOCK_M x BLOCK_K bf16 + BLOCK_K x BLOCK_N fp8 per stage) small enough for 2-3 CTAs per
# SM; SPLIT_K 2-8 multiplies the programs of narrow matrices; SPLIT_K 1 stays for wide ones (gate/up).
# SWAP_AB configs (the weight as wgmma's 64-row side, fp16) need BLOCK_N >= 64 per warpgroup. The set is
# what won somewhere among 17 timed by the autotuner on the H200 (llava-1.5-7b's four matrices at 1, 32
# and 64 rows, BENCHMARKS.md): the swapped ones at 32-64 rows of o, q/k/v and gate/up (11-15% faster
# there), the plain ones elsewhere; each config is compiled per rows bucket at start-up, so losers cost
# seconds of a cold start for nothing.
SPLIT_K_SHAPES = ((64, 128, 2, 4, 4, 0), (64, 128, 4, 4, 4, 0), (64, 256, 1, 4, 3, 0), (32, 128, 8, 4, 4, 0),
                  (64, 256, 1, 4, 3, 1), (64, 256, 2, 4, 3, 1), (64, 128, 8, 4, 4, 1), (128, 128, 1, 4, 4, 1),
                  (128, 128, 2, 4, 4, 1))
# The stream-K form (`_stream_k_product`): (BLOCK_N, BLOCK_K, PROGRAMS_PER_SM, num_warps, num_stages,
# SWAP_AB). PROGRAMS_PER_SM x the shared memory of one program (compiled for sm_90 on a CPU: 53-90 KB at 32
# rows, 82-131 KB at 64) fits an SM's 227 KB, so the grid is one wave. Candidates for the autotuner, not
# yet timed on a GPU.
STREAM_K_SHAPES = ((64, 128, 2, 4, 4, 0), (128, 128, 1, 4, 4, 1), (128, 128, 2, 4, 3, 1),
                   (64, 256, 1, 4, 3, 1))
_MIN_BLOCK_N = min(shape[0] for shape in SPLIT_K_SHAPES + STREAM_K_SHAPES)
# A split K config is kept while its programs number at most this many per SM: beyond, the partials'
# traffic and the last programs' sums cost more than the extra loads in flight bring.
_MAX_PROGRAMS_PER_SM = 8


# MMSERVE_FP8_STREAM_K: "0" (default) offers the autotuner the split-K form only, "1" both forms, "only"
# the stream-K form only (the A/B of bench.profile_step and bench.fp8_gemv). Off by default: on the H200
# (bench.fp8_gemv, llava-1.5-7b, 32 rows) the best stream-K config lost to the best split-K one by 1.1-1.6x,
# and each config offered is one more compile and timing per rows bucket at start-up.
STREAM_K = os.environ.get("MMSERVE_FP8_STREAM_K", "0")


def split_k_configs(stream_k: str | None = None) -> list[triton.Config]:
    """The split-K kernel's configurations: split-K only for "0", both forms for "1", stream-K only for
    "only" (`stream_k` defaults to MMSERVE_FP8_STREAM_K, itself "0"): the autotuner's set; tests run each
    explicitly."""
    stream_k = STREAM_K if stream_k is None else stream_k
    split = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk, "SWAP_AB": bool(sw)}, num_warps=w,
                           num_stages=st)
             for n, k, sk, w, st, sw in SPLIT_K_SHAPES]
    stream = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": 1, "SWAP_AB": bool(sw),
                             "PROGRAMS_PER_SM": per_sm, "THREADS": 32 * w}, num_warps=w, num_stages=st)
              for n, k, per_sm, w, st, sw in STREAM_K_SHAPES]
    if stream_k not in ("0", "1", "only"):
        raise ValueError(f"MMSERVE_FP8_STREAM_K must be 0, 1 or only, not {stream_k!r}")
    return {"0": split, "1": split + stream, "only": stream}[stream_k]


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _sms() -> int:
    return _sm_count(torch.cuda.current_device()) if torch.cuda.is_available() else 132


def stream_k_programs(n: int, k: int, block_n: int, block_k: int, per_sm: int) -> int:
    """The stream-K form's grid for an [n, k] weight: per_sm programs a multiprocessor, fewer where the
    runs of K blocks would be so short that more than MAX_STREAM_PARTS programs met on one tile (a run of
    at least k_tiles / (MAX_STREAM_PARTS - 1) blocks meets at most MAX_STREAM_PARTS)."""
    n_blocks, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    shortest_run = triton.cdiv(k_tiles, MAX_STREAM_PARTS.value - 1)
    return max(1, min(per_sm * _sms(), n_blocks * k_tiles // shortest_run))


def _split_k_grid(n: int, k: int, m_blocks: int, meta: dict) -> tuple[int, int, int]:
    if meta.get("PROGRAMS_PER_SM", 0):
        programs = stream_k_programs(n, k, meta["BLOCK_N"], meta["BLOCK_K"], meta["PROGRAMS_PER_SM"])
        return (programs, 1, m_blocks)
    return (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"], m_blocks)


def _workspace_depth(config: dict) -> int:
    """Partial tiles per output tile a config writes (1: none, the output is written directly)."""
    return MAX_STREAM_PARTS.value if config.get("PROGRAMS_PER_SM", 0) else config["SPLIT_K"]


def _split_k_fits(config: dict, n: int, k: int, per_channel: bool, scale_cols: int) -> bool:
    """Whether the autotuner may try this config for an [n, k] weight."""
    if not per_channel and scale_cols % config["BLOCK_K"]:
        return False
    split = config["SPLIT_K"]
    return split == 1 or (triton.cdiv(k, config["BLOCK_K"]) >= split
                          and triton.cdiv(n, config["BLOCK_N"]) * split <= _MAX_PROGRAMS_PER_SM * _sms())


def _prune_split_k(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    def arg(name):
        return kwargs.get(name, named_args.get(name))

    return [c for c in configs if _split_k_fits(c.kwargs, arg("N"), arg("K"), arg("PER_CHANNEL"),
                                                arg("SCALE_COLS"))]


_split_k = triton.autotune(configs=split_k_configs(), key=KEY, **TUNING,
                           prune_configs_by={"early_config_prune": _prune_split_k})(_split_k_kernel)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # the interpreter cannot autotune
_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, that the split-K kernel leaves zeroed again.

    One buffer per device, shared by every product issued to it: the products of one stream run one
    after another, so they never share a counter at the same time (the decoder issues its products from
    one stream; two streams running split-K products at once on one device would not be safe). Made
    outside graph capture it is kept; under capture a missing or too small buffer is made for that call
    only (its zeroing is a memset node of the graph: a kept one would not be zeroed until a replay)."""
    buf = _counters.get(device)
    if buf is not None and buf.numel() >= tiles:
        return buf
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    buf = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    _counters[device] = buf
    return buf


def split_k_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                bias: torch.Tensor | None, config: dict[str, int] | None = None) -> torch.Tensor:
    """weight_only_fp8 through the split-K kernel (decode's 2-64 rows; any row count works).

    `config` fixes BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages (SWAP_AB, PROGRAMS_PER_SM: tests, the
    interpreter); without it the autotuner picks one of `split_k_configs()` per (rows bucket, matrix).
    Graph-capture safe: the partials' workspace comes from the caching allocator, the counters from
    `_tile_counters`."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    per_channel = block.is_per_channel(k)
    if config is None and _INTERPRETED:
        config = {"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2}
    bucket = max(16, triton.next_power_of_2(m))
    block_m = min(bucket, 64)
    m_blocks = triton.cdiv(m, block_m)
    if config is not None:
        depth = _workspace_depth(config)
    else:
        fits = [c.kwargs for c in split_k_configs() if _split_k_fits(c.kwargs, n, k, per_channel, block.cols)]
        if not fits:
            raise ValueError(f"no split-K configuration fits FP8 scale blocks of {block.cols} columns")
        depth = max(_workspace_depth(c) for c in fits)
    # fp32 partials [depth, m, n], only written by tiles that more than one program adds up (else a
    # stand-in pointer).
    ws = torch.empty((depth, m, n) if depth > 1 else (1,), dtype=torch.float32, device=x.device)
    counters = _tile_counters(x.device, triton.cdiv(n, _MIN_BLOCK_N) * m_blocks)
    args = (x, weight, scale, bias if bias is not None else x, out, ws, counters, m, n, k, x.stride(0),
            weight.stride(0), scale.stride(0), scale.stride(1) if scale.dim() == 2 else 0, out.stride(0))
    flags = dict(SCALE_ROWS=block.rows, SCALE_COLS=block.cols, PER_CHANNEL=per_channel,
                 HAS_BIAS=bias is not None, M_BUCKET=bucket, BLOCK_M=block_m)
    if config is not None:
        if not per_channel and block.cols % config["BLOCK_K"]:
            raise ValueError(f"BLOCK_K {config['BLOCK_K']} does not divide scale blocks of {block.cols}")
        if config["BLOCK_N"] < _MIN_BLOCK_N:
            raise ValueError(f"BLOCK_N below {_MIN_BLOCK_N} needs more tile counters than are kept")
        if config.get("PROGRAMS_PER_SM", 0):  # the stream-K form counts arrivals per thread
            config = {"THREADS": 32 * config.get("num_warps", 4), **config}
            if config["THREADS"] != 32 * config.get("num_warps", 4):
                raise ValueError("THREADS must be 32 x num_warps")
        _split_k_kernel[_split_k_grid(n, k, m_blocks, config)](*args, **flags, **config, **launch_options())
    else:
        _split_k[lambda meta: _split_k_grid(n, k, m_blocks, meta)](*args, **flags, **launch_options())
    return out
