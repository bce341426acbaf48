"""One-row products with their input op fused in, streamed through a TMA ring (Hopper, Gluon).

At batch-1 decode two of a layer's four products follow a small op: RMS norm (with the residual add)
before q/k/v and gate/up, SiLU(gate) x up before down. Each op is a launch of ~2 us that the product
then waits for. Here the product computes its input itself: every program first builds the whole
activation row with its op applied (HF's rounding points, as `triton_ops`) in shared memory, then streams
weight tiles through the ring of `stream_gemv` against it. Building the row costs each program an L2
read of the inputs, so the kernel is persistent: a few programs per SM (`StreamConfig.per_sm`), each
walking its rows blocks (pid, pid + programs, ...) with the ring kept full across them, so the row is
built once per program rather than once per row block.

Whether this beats the separate op + product is measured per shape at start-up (decode_gemv's choice
in TritonOps.norm_linear / act_linear), as for the Triton kernel it replaces on Hopper
(decode_gemv._decode_gemv_kernel, still the path below sm_90 and in the interpreter).

Only imported on GPU paths (and by the tests that compile it for sm_90 on the CPU).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from decoder_svc.model import stream_gemv as sg
from decoder_svc.model.pdl import launch_options, release_dependents, wait_for_inputs

PLAIN, RMS_NORM, SILU_MUL = 0, 1, 2  # as decode_gemv
CHUNK = 8  # input tiles per load while building the row (2 x 256 x 8 values: 16 a thread at 4 warps)


@gluon.jit
def _fetch_item(w_desc, w_tiles, ready, item, total, pid, programs, K_TILES: gl.constexpr,
                STAGES: gl.constexpr):
    # Work item `item` of this program: tile (item % K_TILES) of its (item // K_TILES)-th row block,
    # into ring stage item % STAGES; past its last item it asks nothing.
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    stage = item % STAGES
    wanted = item < total
    n0 = (pid + (item // K_TILES) * programs) * BLOCK_N
    mbarrier.expect(ready.index(stage), w_desc.block_type.nbytes, pred=wanted)
    tma.async_copy_global_to_shared(w_desc, [n0, (item % K_TILES) * BLOCK_K], ready.index(stage),
                                    w_tiles.index(stage), pred=wanted)


@gluon.jit
def _round(x, dtype: gl.constexpr):
    # fp32 -> the activation dtype and back: one rounding where HF's dtype ops round.
    return x.to(dtype).to(gl.float32)


@gluon.jit
def _input_chunk(x_ptr, res_ptr, norm_w_ptr, K, inv_rms, c, PROLOGUE: gl.constexpr,
                 HAS_RESIDUAL: gl.constexpr, CHUNK: gl.constexpr, BLOCK_K: gl.constexpr,
                 layout: gl.constexpr):
    # CHUNK tiles of the product's input from chunk c on, its op applied, rounded where HF rounds:
    # (RMS_NORM, first pass with inv_rms = 0: h = x + residual only).
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    cols = c * CHUNK * BLOCK_K + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))[:, None] * BLOCK_K \
        + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))[None, :]
    ok = cols < K
    if PROLOGUE == 2:  # x is cat(gate, up) of 2K values
        gate = gl.load(x_ptr + cols, mask=ok, other=0.0).to(gl.float32)
        up = gl.load(x_ptr + K + cols, mask=ok, other=0.0).to(gl.float32)
        a = _round(gate / (1.0 + gl.exp(-gate)), dtype) * up
    else:
        a = gl.load(x_ptr + cols, mask=ok, other=0.0).to(gl.float32)
        if PROLOGUE == 1:
            if HAS_RESIDUAL:
                a = _round(a + gl.load(res_ptr + cols, mask=ok, other=0.0).to(gl.float32), dtype)
            if inv_rms != 0.0:
                a = _round(a * inv_rms, dtype) * gl.load(norm_w_ptr + cols, mask=ok, other=0.0).to(gl.float32)
    return a, cols, ok


@gluon.jit
def _build_input(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, x_s, K, eps, pid, PROLOGUE: gl.constexpr,
                 HAS_RESIDUAL: gl.constexpr, CHUNKS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_K: gl.constexpr,
                 WARPS: gl.constexpr):
    # The product's whole input row, its op applied, into x_s [CHUNKS * CHUNK, BLOCK_K], CHUNK tiles per
    # load: the loops are unrolled and the next chunk is loaded before this one is stored, so the row
    # costs a few L2 round trips (stores to shared memory are fenced by barriers, loads cannot pass them).
    layout: gl.constexpr = gl.BlockedLayout([1, 2], [2, 16], [WARPS, 1], [1, 0])
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    inv_rms = 0.0
    if PROLOGUE == 1:  # first pass: the statistic (and program 0 keeps the new residual stream)
        sq = gl.zeros([CHUNK, BLOCK_K], gl.float32, layout)
        for c in gl.static_range(CHUNKS):
            h, cols, ok = _input_chunk(x_ptr, res_ptr, norm_w_ptr, K, 0.0, c, PROLOGUE, HAS_RESIDUAL,
                                       CHUNK, BLOCK_K, layout)
            if HAS_RESIDUAL:
                gl.store(new_res_ptr + cols, h.to(dtype), mask=ok & (pid == 0))
            sq += h * h
        inv_rms = gl.rsqrt(gl.sum(gl.sum(sq, axis=1), axis=0) / K + eps)
    a, cols, ok = _input_chunk(x_ptr, res_ptr, norm_w_ptr, K, inv_rms, 0, PROLOGUE, HAS_RESIDUAL, CHUNK,
                               BLOCK_K, layout)
    for c in gl.static_range(CHUNKS):
        if c + 1 < CHUNKS:
            nxt, cols, ok = _input_chunk(x_ptr, res_ptr, norm_w_ptr, K, inv_rms, c + 1, PROLOGUE,
                                         HAS_RESIDUAL, CHUNK, BLOCK_K, layout)
        x_s.slice(c * CHUNK, CHUNK).store(a.to(dtype))
        if c + 1 < CHUNKS:
            a = nxt


@gluon.jit
def _fused_stream_kernel(w_desc, x_ptr, res_ptr, new_res_ptr, norm_w_ptr, scale_ptr, bias_ptr, out_ptr,
                         N, K, eps, PROLOGUE: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
                         W_SCALED: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                         VEC: gl.constexpr, THREADS_K: gl.constexpr, WARPS: gl.constexpr,
                         K_TILES: gl.constexpr, CHUNKS: gl.constexpr, CHUNK: gl.constexpr,
                         ROWS: gl.constexpr):
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // THREADS_K, THREADS_K], [WARPS, 1], [1, 0])
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    total = gl.cdiv(gl.cdiv(N, BLOCK_N) - pid, programs) * K_TILES  # this program's (row block, tile)s

    w_tiles = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    # The input row, unswizzled: written CHUNK tiles at a time as 2-D blocks, read one tile at a time
    # (the same bytes seen as rows of 1-D tiles). ROWS >= CHUNKS * CHUNK, a power of two (layouts).
    x_s = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [ROWS, BLOCK_K],
                                    gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    x_rows = x_s._reinterpret(x_ptr.dtype.element_ty, [ROWS, BLOCK_K],
                              gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(ready.index(stage), count=1)
    for item in gl.static_range(STAGES):  # weights first: never written (pdl.py)
        _fetch_item(w_desc, w_tiles, ready, item, total, pid, programs, K_TILES, STAGES)
    wait_for_inputs()
    _build_input(x_ptr, res_ptr, new_res_ptr, norm_w_ptr, x_s, K, eps, pid, PROLOGUE, HAS_RESIDUAL,
                 CHUNKS, CHUNK, BLOCK_K, WARPS)
    gl.thread_barrier()  # the whole row is in x_s before any warp reads another's part

    rn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
    for item in range(total):
        slot = item % STAGES
        kt = item % K_TILES
        mbarrier.wait(ready.index(slot), (item // STAGES) & 1)
        w = w_tiles.index(slot).load(layout)
        fence_async_shared()  # the stage is read before it is refilled (stream_gemv)
        gl.thread_barrier()
        _fetch_item(w_desc, w_tiles, ready, item + STAGES, total, pid, programs, K_TILES, STAGES)
        x = x_rows.index(kt).load(gl.SliceLayout(0, layout)).to(gl.float32)
        acc += w.to(gl.float32) * x[None, :]
        if kt == K_TILES - 1:  # a row block is done: its outputs, then the next block from zero
            rows = (pid + (item // K_TILES) * programs) * BLOCK_N + rn
            out = gl.sum(acc, axis=1)
            if W_SCALED:
                out = out * gl.load(scale_ptr + rows, mask=rows < N, other=0.0)
            if HAS_BIAS:
                out += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
            gl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)
            acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
    release_dependents()
    for stage in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(stage))


@functools.cache
def _sm_resources(device: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.shared_memory_per_multiprocessor


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
            prologue: int, residual: torch.Tensor | None, new_residual: torch.Tensor | None,
            norm_weight: torch.Tensor | None, eps: float, out: torch.Tensor,
            config: sg.StreamConfig) -> torch.Tensor:
    n, k = weight.shape
    desc = sg.weight_descriptor(weight, config.block_n)
    k_tiles = triton.cdiv(k, desc.block_shape[1])
    chunks = triton.cdiv(k_tiles, CHUNK)
    rows = triton.next_power_of_2(chunks * CHUNK)
    # As many programs per SM as fit beside each other (the row alone is up to 64 KB): a program that
    # does not fit would run in a second wave, after the others have done their share.
    row_bytes = rows * desc.block_shape[1] * x.element_size()
    smem = config.stages * config.block_n * sg.ROW_BYTES + row_bytes + 2048
    sms, smem_per_sm = _sm_resources(x.device.index or 0)
    programs = min(triton.cdiv(n, config.block_n), max(min(config.per_sm, smem_per_sm // smem), 1) * sms)

    def given(t: torch.Tensor | None) -> torch.Tensor:
        return x if t is None else t  # a pointer the kernel never reads when its flag is off

    _fused_stream_kernel[(programs,)](
        desc, x, given(residual), given(new_residual), given(norm_weight), given(scale), given(bias), out,
        n, k, eps, PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, W_SCALED=scale is not None,
        HAS_BIAS=bias is not None, STAGES=config.stages, VEC=16 // weight.element_size(),
        THREADS_K=sg.ROW_BYTES // 16, WARPS=config.warps, K_TILES=k_tiles, CHUNKS=chunks, CHUNK=CHUNK,
        ROWS=rows, num_warps=config.warps, **launch_options())
    return out


def fused_stream_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                      bias: torch.Tensor | None, prologue: int, residual: torch.Tensor | None = None,
                      norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                      config: sg.StreamConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """decode_gemv.fused_gemv's contract (one row; RMS_NORM with the new residual in a NEW tensor,
    SILU_MUL over x = cat(gate, up)) on the TMA ring, persistent. `config` fixes the tiling (tests),
    else the fastest of sg.FUSED_CONFIGS for this shape and op, measured once (sg.choose)."""
    x = x.contiguous()
    scale = None if scale is None else scale.reshape(-1)
    new_residual = None
    if prologue == RMS_NORM:
        new_residual = x if residual is None else torch.empty_like(x)
        residual = None if residual is None else residual.contiguous()
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    if config is None:
        def launch(w: torch.Tensor, s: torch.Tensor | None, c: sg.StreamConfig) -> torch.Tensor:
            scratch = None if new_residual is None or residual is None else torch.empty_like(x)
            return _launch(x, w, s, bias, prologue, residual, scratch, norm_weight, eps, out, c)

        config = sg.choose(x, weight, scale, bias, op=f"fused{prologue}", configs=sg.FUSED_CONFIGS,
                           launch=launch)
    _launch(x, weight, scale, bias, prologue, residual, new_residual, norm_weight, eps, out, config)
    return out, new_residual
