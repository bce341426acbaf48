"""One-row weight products that stream the weight through shared memory with TMA (Hopper, Gluon).

At batch-1 decode every product is a GEMV: y [N] = W [N, K] x [K], bound by how fast W comes from
memory. A GEMV written in plain Triton keeps one weight tile per warp in flight: its loads land in
registers, and a second tile in flight costs registers and occupancy (measured on the H200: ~3.0 TB/s
of the 4.26 a copy reaches). Here each program owns BLOCK_N weight rows and walks K through a ring of
STAGES shared-memory tiles filled by the Tensor Memory Accelerator: one thread asks for a whole tile
(and the matching 512 bytes of activations, so that no global load sits in the loop), an mbarrier says
when it has landed, and STAGES tiles stay in flight per program whatever the registers hold. The warps
read a landed tile into registers (16 bytes a thread), hand the stage back (a CTA barrier, then the next
tile's copy into it) and multiply while the copies go on, accumulating in fp32 and reducing over K once
at the end. FP8 weights carry one scale per output row, applied once.

Measured on the H200 (bench.fp8_gemv, llava-1.5-7b's matrices): bf16 weights stream at 3.3-4.1 TB/s
(cuBLAS 2.7-3.9), FP8 at 2.5-3.6 (the Triton GEMV 2.6-3.2): an FP8 byte is a weight to widen and multiply
where a bf16 byte is half of one, and each program's loop (wait, barrier, refill, multiply) rather than
the bytes in flight bounds it. A tensor-core variant for FP8 (mma m16n8k16) was 2-3x slower, and a
persistent variant building the RMS-normed / SiLU x up input itself 1-3.5 us slower than the separate op
+ this kernel (its programs' row building costs more than the op's launch): both removed.

Plain Triton 3.6 does not multi-buffer a load that feeds no `tl.dot`, so the ring is written out in
Gluon (`triton.experimental.gluon`: explicit layouts, shared memory and barriers). Gluon has no
interpreter: on the CPU and below sm_90 `usable()` is False and the callers keep their Triton or cuBLAS
products. The configuration (rows per program, stages, warps) is measured per weight shape on first use
(`choose`), never inside a CUDA graph capture. `MMSERVE_STREAM_GEMV=0` turns the kernel off (the
benchmarks' A/B).

Only imported on GPU paths (and by the tests that compile it for sm_90 on the CPU).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from common.kernels.graph_timing import copy_count, graph_time_us
from common.kernels.pdl import launch_options, release_dependents, wait_for_inputs

log = logging.getLogger("mmserve.decoder.stream_gemv")

ENV = "MMSERVE_STREAM_GEMV"
ROW_BYTES = 256  # one tile row: 256 FP8 or 128 bf16 weights (a TMA box's inner side, 16 bytes a thread)
WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float16)


@gluon.jit
def _fetch_weights(w_desc, x_desc, w_tiles, ready, n0, stage, step, num_steps, BOXES: gl.constexpr):
    # Ask the TMA for step `step`'s BOXES weight tiles (of this program's rows, consecutive along K) into
    # ring stage `stage`, whose barrier then waits for their weight and activation bytes; past the last
    # step it asks nothing.
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    wanted = step < num_steps
    mbarrier.expect(ready.index(stage), BOXES * (w_desc.block_type.nbytes + x_desc.block_type.nbytes),
                    pred=wanted)
    for box in gl.static_range(BOXES):
        tma.async_copy_global_to_shared(w_desc, [n0, (step * BOXES + box) * BLOCK_K], ready.index(stage),
                                        w_tiles.index(stage * BOXES + box), pred=wanted)


@gluon.jit
def _fetch_activations(x_desc, x_tiles, ready, stage, step, num_steps, BOXES: gl.constexpr):
    # The activations of step `step` into the same stage (512-byte copies, read from L2).
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[0]
    for box in gl.static_range(BOXES):
        tma.async_copy_global_to_shared(x_desc, [(step * BOXES + box) * BLOCK_K], ready.index(stage),
                                        x_tiles.index(stage * BOXES + box), pred=step < num_steps)


@gluon.jit
def _stream_gemv_kernel(w_desc, x_desc, scale_ptr, bias_ptr, out_ptr, N, K,
                        W_SCALED: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                        VEC: gl.constexpr, THREADS_K: gl.constexpr, WARPS: gl.constexpr,
                        BOXES: gl.constexpr = 1):
    # A ring stage holds BOXES tiles along K (the launch checks that they divide K's tiles): one wait,
    # barrier and refill per BOXES tiles.
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // THREADS_K, THREADS_K], [WARPS, 1], [1, 0])
    n0 = gl.program_id(0) * BLOCK_N
    num_steps = gl.cdiv(K, BLOCK_K) // BOXES

    w_tiles = gl.allocate_shared_memory(w_desc.dtype, [STAGES * BOXES, BLOCK_N, BLOCK_K], w_desc.layout)
    x_tiles = gl.allocate_shared_memory(x_desc.dtype, [STAGES * BOXES, BLOCK_K], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(ready.index(stage), count=1)
    # The ring's weights are asked for before waiting for the kernel before (weights are never written:
    # pdl.py), its activations after.
    for stage in gl.static_range(STAGES):
        _fetch_weights(w_desc, x_desc, w_tiles, ready, n0, stage, stage, num_steps, BOXES)
    wait_for_inputs()
    for stage in gl.static_range(STAGES):
        _fetch_activations(x_desc, x_tiles, ready, stage, stage, num_steps, BOXES)

    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
    for t in range(num_steps):
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        w = w_tiles.index(slot * BOXES).load(layout)
        x = x_tiles.index(slot * BOXES).load(gl.SliceLayout(0, layout))
        if BOXES == 2:
            w2 = w_tiles.index(slot * BOXES + 1).load(layout)
            x2 = x_tiles.index(slot * BOXES + 1).load(gl.SliceLayout(0, layout))
        # Every warp holds its part of the stage before the TMA may overwrite it (the reads are the
        # generic proxy's, the copies the async proxy's: fence, then barrier). No global load is in
        # flight here, so the fence waits for nothing (activations read from global memory in the loop
        # made every iteration wait out an L2 round trip at this fence: measured, 0.45 us a tile).
        fence_async_shared()
        gl.thread_barrier()
        _fetch_weights(w_desc, x_desc, w_tiles, ready, n0, slot, t + STAGES, num_steps, BOXES)
        _fetch_activations(x_desc, x_tiles, ready, slot, t + STAGES, num_steps, BOXES)
        acc += w.to(gl.float32) * x.to(gl.float32)[None, :]
        if BOXES == 2:
            acc += w2.to(gl.float32) * x2.to(gl.float32)[None, :]
    release_dependents()  # the next product may start filling its ring while this one ends
    for stage in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(stage))

    out = gl.sum(acc, axis=1)
    rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    n_mask = rn < N
    if W_SCALED:
        out = out * gl.load(scale_ptr + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        out += gl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(gl.float32)
    gl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@dataclass(frozen=True)
class StreamConfig:
    """Rows per program, ring stages, warps, and tiles per stage (the tile is BLOCK_N rows of ROW_BYTES;
    a stage of `boxes` tiles consecutive along K takes one wait, barrier and refill)."""

    block_n: int
    stages: int
    warps: int
    boxes: int = 1

    @property
    def name(self) -> str:
        """n<rows>st<stages>w<warps>[b<boxes>], as benchmarks report it."""
        return f"n{self.block_n}st{self.stages}w{self.warps}" + (f"b{self.boxes}" if self.boxes > 1 else "")

    def fits(self) -> bool:
        """Whether the warps' register layout covers the tile without repeating rows."""
        return self.block_n >= (32 // (ROW_BYTES // 16)) * self.warps and self.boxes in (1, 2)

    def takes(self, weight: torch.Tensor) -> bool:
        """Whether a weight's K tiles come in whole stages (a stage of two tiles needs an even count)."""
        return -(-weight.shape[1] * weight.element_size() // ROW_BYTES) % self.boxes == 0


# Shared memory per program is stages x boxes x block_n x 256 bytes plus the activations: several
# programs fit on an SM. The first three won on the H200 for llava-1.5-7b's four matrices, FP8 and bf16
# (bench.fp8_gemv): of n8 / n16 / n32 / n64 rows, 4 / 6 / 8 stages, 4 / 8 warps, more stages or warps
# never won (each iteration's wait, barrier and refill, not the bytes in flight, bound a program). The
# two-tile stages halve those per byte at the same programs per matrix (SASS: 5% fewer instructions a
# weight, the widening and multiplying being most of them); on the H200 they won three of llava's bf16
# products and its FP8 gate_up by 1-9%.
CONFIGS = (StreamConfig(16, 4, 4), StreamConfig(16, 8, 4), StreamConfig(32, 4, 4), StreamConfig(16, 4, 4, 2),
           StreamConfig(32, 3, 4, 2))


@dataclass(frozen=True)
class StreamKey:
    """What a choice is made for: a weight's shape and dtype, scaled or not, a bias, and the rival."""

    n: int
    k: int
    dtype: torch.dtype
    scaled: bool
    bias: bool
    rival: str


@dataclass
class StreamChoice:
    """A measured choice: the config to launch (None: the rival was faster) and every time measured."""

    config: StreamConfig | None
    times_us: dict[str, float] = field(default_factory=dict)


CHOICES: dict[StreamKey, StreamChoice] = {}  # one per process: the shapes are the model's


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: a Hopper (or later) GPU, not turned off by MMSERVE_STREAM_GEMV=0."""
    if os.environ.get(ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether one row x [1, K] times weight [N, K] can take the kernel (TMA: 16-byte aligned rows)."""
    if not available() or not x.is_cuda or x.shape[0] != 1 or weight.dim() != 2 or weight.stride(1) != 1:
        return False
    if weight.dtype not in WEIGHT_DTYPES or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    size = weight.element_size()
    aligned = (weight.stride(0) * size) % 16 == 0 and weight.data_ptr() % 16 == 0
    return aligned and weight.shape[1] * size >= 16


def _descriptors(x: torch.Tensor, weight: torch.Tensor, block_n: int) -> tuple[TensorDescriptor, ...]:
    # The weight and the activation row as the TMA reads them: tiles of block_n rows x 256 bytes and the
    # matching K slice of x, unswizzled (each warp reads whole rows). Built per launch (cheap; a CUDA
    # graph keeps the ones it captured).
    bits = weight.element_size() * 8
    block_k = ROW_BYTES * 8 // bits
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=2)
    x_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=x.element_size() * 8, rank=1)
    return (TensorDescriptor(weight, list(weight.shape), [weight.stride(0), 1], [block_n, block_k], w_layout),
            TensorDescriptor(x, [x.shape[-1]], [1], [block_k], x_layout))


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
            out: torch.Tensor, config: StreamConfig) -> torch.Tensor:
    n, k = weight.shape
    if x.data_ptr() % 16:  # the TMA reads from 16-byte aligned addresses only (a row sliced off a buffer)
        x = x.clone()
    if not config.takes(weight):
        raise ValueError(f"{config.name} streams {config.boxes} tiles a stage: K = {k} is not whole stages")
    _stream_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        *_descriptors(x, weight, config.block_n), x if scale is None else scale, x if bias is None else bias,
        out, n, k, W_SCALED=scale is not None, HAS_BIAS=bias is not None, STAGES=config.stages,
        VEC=16 // weight.element_size(), THREADS_K=ROW_BYTES // 16, WARPS=config.warps, BOXES=config.boxes,
        num_warps=config.warps, **launch_options())
    return out


Rival = Callable[[torch.Tensor, torch.Tensor | None], object]  # (weight, scale) -> the caller's product


def choose(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, rival: Rival | None = None,
           rival_name: str = "") -> StreamConfig | None:
    """The config to launch for this weight, or None where `rival` (the caller's own product, named
    `rival_name`) was faster. Measured once per StreamKey as decode runs it: every config (and the rival)
    over enough copies of the weight that none is read from L2, back to back in a replayed CUDA graph
    (graph_timing.graph_time_us). Never measured inside a graph capture: an unmeasured key there takes the
    rival, or the first config without one."""
    key = StreamKey(*weight.shape, weight.dtype, scale is not None, bias is not None, rival_name)
    if key in CHOICES:
        return CHOICES[key].config
    candidates = [c for c in CONFIGS if c.fits() and c.takes(weight)]
    if torch.cuda.is_current_stream_capturing():
        return None if rival is not None else candidates[0]
    scale = None if scale is None else scale.reshape(-1)
    copies = _weight_copies(weight, scale)
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    times = {c.name: graph_time_us([functools.partial(_launch, x, w, s, bias, out, c) for w, s in copies])
             for c in candidates}
    if rival is not None:
        times[rival_name or "rival"] = graph_time_us([functools.partial(rival, w, s) for w, s in copies])
    del copies
    fastest = min(times, key=times.get)
    config = next((c for c in candidates if c.name == fastest), None)
    CHOICES[key] = StreamChoice(config, times)
    log.info("stream GEMV %dx%d %s: %s (%.1f us; %s)", key.n, key.k, str(key.dtype).removeprefix("torch."),
             fastest, times[fastest], ", ".join(f"{name} {us:.1f}" for name, us in times.items()))
    return config


def _weight_copies(weight: torch.Tensor, scale: torch.Tensor | None) -> list[tuple]:
    # The weight and enough copies of it that timing them in turn streams every one from memory.
    count = copy_count(weight.numel() * weight.element_size(), weight.device)
    return [(weight, scale)] + [(weight.clone(), None if scale is None else scale.clone())
                                for _ in range(count - 1)]


def stream_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, config: StreamConfig | None = None) -> torch.Tensor:
    """x [1, K] @ (weight [N, K] * scale [N])^T + bias -> [1, N] in x's dtype (`usable` must hold).

    weight: bf16/fp16, or FP8 e4m3 with fp32 `scale` (one per output row, any shape of N values).
    Products in fp32, one rounding at the end. `config` fixes the tiling (tests), else `choose` picks it."""
    x = x.contiguous()
    scale = None if scale is None else scale.reshape(-1)
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    return _launch(x, weight, scale, bias, out, config or choose(x, weight, scale, bias))
