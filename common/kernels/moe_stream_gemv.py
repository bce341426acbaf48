"""Mixture-of-experts GEMVs for a few tokens with the experts' weights streamed by TMA (Hopper, Gluon).

moe_gemv.py's plain-Triton GEMV keeps one weight tile per warp in flight and reads the chosen experts well
below the rate stream_gemv.py's TMA ring reaches for the dense products (BENCHMARKS.md,
Qwen3-VL-30B-A3B). This is that ring for one (token, slot) assignment per program row: the experts'
stacked weights [E, N, K] are one [E * N, K] TMA descriptor, and a program streams BLOCK_N rows of its
assignment's expert through STAGES shared-memory tiles. The expert is the router's output, so unlike the
dense kernel nothing can be fetched before the wait (pdl.py). The program's activation row (a token's
hidden state, or silu(g) * u of an assignment's gate/up row, rounded as torch rounds) is built once into
shared memory while the first tiles land; the loop then reads no global memory.

Same contract and rounding as moe_gemv.gemv_moe (gate/up, down scaled by the routing weight, fused_moe's
combine). FP8 experts: one scale per expert and output channel, applied once. Only on Hopper or later
(`usable`); moe_tuning.choose_config measures it beside the other paths and keeps it only where it computes
what the default tiling computes.

Only imported on GPU paths (and by the tests that compile it for sm_90 on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from common.kernels.fused_moe import check_expert_scales, combine
from common.kernels.pdl import launch_options, release_dependents, wait_for_inputs
from common.kernels.stream_gemv import ROW_BYTES, WEIGHT_DTYPES, available


@dataclass(frozen=True)
class StreamMoeConfig:
    """Weight rows per program (each tile ROW_BYTES wide along K), ring stages, warps."""

    block_n: int = 16
    stages: int = 4
    warps: int = 4

    @property
    def name(self) -> str:
        return f"tma{self.block_n}st{self.stages}w{self.warps}"


CONFIGS = (StreamMoeConfig(16, 4, 4), StreamMoeConfig(32, 4, 4), StreamMoeConfig(16, 6, 4),
           StreamMoeConfig(8, 6, 4))


@gluon.jit
def _fetch(w_desc, w_tiles, ready, n0, stage, step, num_steps):
    # Ask the TMA for step `step`'s weight tile into ring stage `stage`; past the last step nothing.
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    wanted = step < num_steps
    mbarrier.expect(ready.index(stage), w_desc.block_type.nbytes, pred=wanted)
    tma.async_copy_global_to_shared(w_desc, [n0, step * BLOCK_K], ready.index(stage), w_tiles.index(stage),
                                    pred=wanted)


@gluon.jit
def _expert_stream_kernel(w_desc, a_ptr, ids_ptr, weights_ptr, scale_ptr, out_ptr, N, K, stride_am,
                          stride_om, TOP_K: gl.constexpr, A_PER_TOKEN: gl.constexpr, A_SWIGLU: gl.constexpr,
                          MUL_WEIGHT: gl.constexpr, W_SCALED: gl.constexpr, STAGES: gl.constexpr,
                          VEC: gl.constexpr, THREADS_K: gl.constexpr, WARPS: gl.constexpr,
                          K_TILES: gl.constexpr):
    # out[r, n] = A[a(r)] . W[ids[r]][n] (* scale) (* weights[r]); programs (assignments, N / BLOCK_N).
    # K_TILES: K / BLOCK_K rounded up (the activation row's tiles in shared memory).
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // THREADS_K, THREADS_K], [WARPS, 1], [1, 0])
    r = gl.program_id(0)
    n_local = gl.program_id(1) * BLOCK_N
    num_steps = gl.cdiv(K, BLOCK_K)

    w_tiles = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(ready.index(stage), count=1)
    wait_for_inputs()  # the expert to stream is the router's output
    expert = gl.load(ids_ptr + r)
    n0 = expert * N + n_local
    for stage in gl.static_range(STAGES):
        _fetch(w_desc, w_tiles, ready, n0, stage, stage, num_steps)

    # The activation row into shared memory, once, while the first tiles land.
    if A_PER_TOKEN:
        a_row = r // TOP_K
    else:
        a_row = r
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    row_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    x_tiles = gl.allocate_shared_memory(dtype, [K_TILES, BLOCK_K], row_layout)
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    base = a_ptr + a_row.to(gl.int64) * stride_am
    for tile in gl.static_range(K_TILES):
        idx = tile * BLOCK_K + cols
        a = gl.load(base + idx, mask=idx < K, other=0.0)
        if A_SWIGLU:
            g = a.to(gl.float32)
            up = gl.load(base + K + idx, mask=idx < K, other=0.0).to(gl.float32)
            silu = (g / (1.0 + gl.exp(-g))).to(dtype).to(gl.float32)
            a = (silu * up).to(dtype)
        x_tiles.index(tile).store(a)
    gl.thread_barrier()

    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
    for t in range(num_steps):
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        w = w_tiles.index(slot).load(layout)
        x = x_tiles.index(t).load(gl.SliceLayout(0, layout))
        # every warp holds its part of the stage before the TMA may overwrite it (stream_gemv.py)
        fence_async_shared()
        gl.thread_barrier()
        _fetch(w_desc, w_tiles, ready, n0, slot, t + STAGES, num_steps)
        acc += w.to(gl.float32) * x.to(gl.float32)[None, :]
    release_dependents()
    for stage in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(stage))

    out = gl.sum(acc, axis=1)
    rn = n_local + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    n_mask = rn < N
    if W_SCALED:
        out = out * gl.load(scale_ptr + expert * N + rn, mask=n_mask, other=0.0)
    if MUL_WEIGHT:
        out = out * gl.load(weights_ptr + r).to(gl.float32)
    gl.store(out_ptr + r.to(gl.int64) * stride_om + rn, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def usable(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether these experts can take the kernel: a Hopper GPU (stream_gemv.available), contiguous
    stacked weights of a TMA dtype with 16-byte aligned rows, activations in bf16 or fp16."""
    if not available() or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    for w in (gate_up, down):
        if w.dtype not in WEIGHT_DTYPES or not w.is_contiguous() or w.data_ptr() % 16:
            return False
        if (w.shape[2] * w.element_size()) % 16:
            return False
    return True


def _product(a: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, row_weights: torch.Tensor,
             scale: torch.Tensor | None, rows: int, k: int, top_k: int, config: StreamMoeConfig,
             a_per_token: bool, swiglu: bool) -> torch.Tensor:
    experts, n, _ = weights.shape
    bits = weights.element_size() * 8
    block_k = ROW_BYTES * 8 // bits
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=2)
    flat = weights.view(experts * n, k)
    desc = TensorDescriptor(flat, list(flat.shape), [k, 1], [config.block_n, block_k], layout)
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    flat_scale = out if scale is None else scale.reshape(-1)  # never read without W_SCALED
    _expert_stream_kernel[(rows, triton.cdiv(n, config.block_n))](
        desc, a, ids, row_weights, flat_scale, out, n, k, a.stride(0), out.stride(0),
        TOP_K=top_k, A_PER_TOKEN=a_per_token, A_SWIGLU=swiglu, MUL_WEIGHT=swiglu,
        W_SCALED=scale is not None, STAGES=config.stages, VEC=16 // weights.element_size(),
        THREADS_K=ROW_BYTES // 16, WARPS=config.warps, K_TILES=triton.cdiv(k, block_k),
        num_warps=config.warps, **launch_options())
    return out


def stream_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, config: StreamMoeConfig | None = None,
               gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None
               ) -> torch.Tensor:
    """moe_gemv.gemv_moe's contract (x [T, H] through the experts, combined) through the TMA ring
    (`usable` must hold)."""
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    check_expert_scales(gate_up, down, gate_up_scale, down_scale)
    config = config or CONFIGS[0]
    x = x.contiguous()
    # int32 expert ids (the router kernel's; torch.topk's int64 would make 64-bit TMA coordinates)
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    row_weights = topk_weights.reshape(-1).contiguous()
    rows = tokens * top_k
    h = _product(x, gate_up, ids, row_weights, gate_up_scale, rows, gate_up.shape[2], top_k, config,
                 a_per_token=True, swiglu=False)
    out = _product(h, down, ids, row_weights, down_scale, rows, down.shape[2], top_k, config,
                   a_per_token=False, swiglu=True)
    return combine(out, tokens, top_k)
