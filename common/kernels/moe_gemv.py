"""Mixture-of-experts feed-forward for a few tokens: one GEMV per (token, slot) assignment, no sort.

At one decode token each of the top_k chosen experts multiplies a single row, so the grouped GEMM's
block-aligned sort buys nothing: its BLOCK_M-row tiles are one row and padding, its grid is top_k blocks
times the N tiles (at top-8 and N of a few thousand, a wave and a half of programs on an H100's SMs),
and the sort itself is one more launch per layer. Here every program takes its assignment's expert
straight from the router's ids and streams BLOCK_N of that expert's weight rows over all K, like the
dense one-row product (decode_gemv.py): many small programs keep the memory system busy. The layer is
gate/up, down, combine (`gemv_moe`, from ids), or with `routed_gemv_moe` the gate/up programs make the
router's choice themselves from its logits (moe_route.top_k_of: a softmax and top-k over a hundred-odd
values, cheaper than a launch), and with `fuse_combine` the down programs sum the slots: two launches
where the grouped path takes five (route, sort, gate/up, down, combine).

Rounding follows fused_moe.py's: the gate/up rows in the activations' dtype, silu(g) * u rounded as
torch's two elementwise ops round, each slot's down row scaled by its routing weight in fp32 and rounded
once, the slots summed in slot order in fp32 and rounded once. With `fuse_combine` one program makes a
token's output columns from all top_k slots in that order, so the result is the same as the separate
combine's.

Above a few tokens the assignments re-read the experts they share (each GEMV streams its expert again),
so which path a batch takes is measured with the grouped GEMM's tilings (moe_tuning.choose_config).
Every launch is a programmatic dependent launch on Hopper (pdl.py): nothing, not even the weights, is
read before the wait, the expert being the router's output.

Only imported on GPU paths or under TRITON_INTERPRET=1 (tests/engine/test_fused_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.kernels.elementwise import _round
from common.kernels.fused_moe import check_expert_scales, combine
from common.kernels.moe_route import check_logits, top_k_of
from common.kernels.pdl import launch_options, release_dependents, wait_for_inputs


@dataclass(frozen=True)
class GemvConfig:
    """Weight rows and columns per program tile, warps, and whether the down product also sums each
    token's slots (then its programs are (tokens, N / block_n), each walking all top_k experts)."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    fuse_combine: bool = False

    @property
    def name(self) -> str:
        combined = "+combine" if self.fuse_combine else ""
        return f"gemv{self.block_n}x{self.block_k}/{self.num_warps}w{combined}"


@triton.jit
def _slot_row(a_ptr, w_ptr, w_scale_ptr, expert, a_row, offs_n, n_ok, N, K,
              stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
              A_SWIGLU: tl.constexpr, W_SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    # [BLOCK_N] fp32: A's row a_row times columns offs_n of expert `expert`'s weight [N, K], scaled per
    # column for FP8 weights. A_SWIGLU: A's row is [g | u] of 2K values, the product's input silu(g) * u.
    dtype = a_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_row.to(tl.int64) * stride_am
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
              + offs_k[None, :] * stride_wk)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(a_base + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if A_SWIGLU:
            up = tl.load(a_base + K + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            silu = _round(a / (1.0 + tl.exp(-a)), dtype).to(tl.float32)
            a = _round(silu * up, dtype).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
        w_ptrs += BLOCK_K * stride_wk
    out = tl.sum(acc, axis=1)
    if W_SCALED:
        out = out * tl.load(w_scale_ptr + expert.to(tl.int64) * stride_se + offs_n * stride_sn, mask=n_ok,
                            other=0.0)
    return out


@triton.jit
def _expert_gemv_kernel(
    a_ptr, w_ptr, ids_ptr, weights_ptr, w_scale_ptr, out_ptr, logits_ptr, N, K, num_experts,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_om, stride_lt,
    TOP_K: tl.constexpr, A_PER_TOKEN: tl.constexpr, A_SWIGLU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    W_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUTE: tl.constexpr = False, RENORMALIZE: tl.constexpr = False, E_PAD: tl.constexpr = 1,
    K_PAD: tl.constexpr = 1,
):
    """out[r, n] = A[a(r)] . W[ids[r]][n] (* w_scale) (* weights[r]) for assignment r = t * TOP_K + k;
    a(r) = t when A_PER_TOKEN, else r. ROUTE: the router's choice is made here first (moe_route.top_k_of
    over token t's logits [num_experts], each program for itself), and the programs of the first N block
    write ids[r] and weights[r] (in the logits' dtype) for the down product. Programs: (assignments,
    N / BLOCK_N)."""
    wait_for_inputs()  # the expert to stream is the router's output
    r = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if ROUTE:
        t = r // TOP_K
        experts = tl.arange(0, E_PAD)
        live = experts < num_experts
        logits = tl.load(logits_ptr + t.to(tl.int64) * stride_lt + experts, mask=live,
                         other=-float("inf")).to(tl.float32)
        probs, chosen = top_k_of(logits[None, :], live, TOP_K, K_PAD, RENORMALIZE)
        mine = tl.arange(0, K_PAD)[None, :] == r % TOP_K
        expert = tl.sum(tl.where(mine, chosen, 0))
        if tl.program_id(1) == 0:
            tl.store(ids_ptr + r, expert)
            tl.store(weights_ptr + r, tl.sum(tl.where(mine, probs, 0.0)).to(weights_ptr.dtype.element_ty))
    else:
        expert = tl.load(ids_ptr + r)
    if A_PER_TOKEN:
        a_row = r // TOP_K
    else:
        a_row = r
    out = _slot_row(a_ptr, w_ptr, w_scale_ptr, expert, a_row, offs_n, n_ok, N, K, stride_am, stride_we,
                    stride_wn, stride_wk, stride_se, stride_sn, A_SWIGLU, W_SCALED, BLOCK_N, BLOCK_K)
    release_dependents()
    if MUL_WEIGHT:
        out = out * tl.load(weights_ptr + r).to(tl.float32)
    out_base = out_ptr + r.to(tl.int64) * stride_om
    tl.store(out_base + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _expert_gemv_combine_kernel(
    a_ptr, w_ptr, ids_ptr, weights_ptr, w_scale_ptr, out_ptr, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_om,
    TOP_K: tl.constexpr, W_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[t, n] = sum over k in slot order of round(weights[r] * (silu(g) * u)[r] . W[ids[r]][n]) with
    r = t * TOP_K + k, A's rows [g | u]; fp32 sum, rounded once. Programs: (tokens, N / BLOCK_N)."""
    wait_for_inputs()
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        r = t * TOP_K + k
        expert = tl.load(ids_ptr + r)
        row = _slot_row(a_ptr, w_ptr, w_scale_ptr, expert, r, offs_n, n_ok, N, K, stride_am, stride_we,
                        stride_wn, stride_wk, stride_se, stride_sn, True, W_SCALED, BLOCK_N, BLOCK_K)
        total += _round(row * tl.load(weights_ptr + r).to(tl.float32), dtype).to(tl.float32)
    release_dependents()
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, total.to(dtype), mask=n_ok)


def _launch(kernel, grid: tuple[int, int], a: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            row_weights: torch.Tensor, weight_scale: torch.Tensor | None, out: torch.Tensor, k: int,
            config: GemvConfig, logits: torch.Tensor | None = None, **constants) -> None:
    w_scale = weight_scale if weight_scale is not None else out  # never read without W_SCALED
    route = {}
    if kernel is _expert_gemv_kernel:
        route = {"logits_ptr": out if logits is None else logits,  # never read without ROUTE
                 "num_experts": weights.shape[0], "stride_lt": 0 if logits is None else logits.stride(0)}
    kernel[grid](
        a, weights, ids, row_weights, w_scale, out, N=weights.shape[1], K=k,
        stride_am=a.stride(0), stride_we=weights.stride(0), stride_wn=weights.stride(1),
        stride_wk=weights.stride(2), stride_se=w_scale.stride(0), stride_sn=w_scale.stride(1),
        stride_om=out.stride(0), W_SCALED=weight_scale is not None, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, **route, **constants, **launch_options(),
    )


def gemv_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, config: GemvConfig | None = None,
             gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None
             ) -> torch.Tensor:
    """fused_moe.fused_moe's contract (x [T, H] through the experts, each token's top_k rows weighted and
    summed; FP8 experts with per-channel scales), computed one assignment at a time without a sort."""
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    check_expert_scales(gate_up, down, gate_up_scale, down_scale)
    config = config or GemvConfig()
    ids, row_weights = topk_ids.reshape(-1), topk_weights.reshape(-1)
    h = _gate_up(x, gate_up, ids, row_weights, gate_up_scale, top_k, config)
    return _down(h, down, ids, row_weights, down_scale, tokens, top_k, config)


def routed_gemv_moe(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool,
                    gate_up: torch.Tensor, down: torch.Tensor, config: GemvConfig | None = None,
                    gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """gemv_moe from the router's logits [T, experts]: moe_route.route_topk's choice (the same weights
    and experts, ties lowest expert first) made by the gate/up product's programs themselves, one launch
    fewer a layer."""
    check_logits(logits, top_k)
    tokens = x.shape[0]
    if tokens == 0:
        return torch.zeros_like(x)
    check_expert_scales(gate_up, down, gate_up_scale, down_scale)
    config = config or GemvConfig()
    ids = torch.empty(tokens * top_k, dtype=torch.int32, device=x.device)
    row_weights = torch.empty(tokens * top_k, dtype=logits.dtype, device=x.device)
    h = _gate_up(x, gate_up, ids, row_weights, gate_up_scale, top_k, config, logits,
                 ROUTE=True, RENORMALIZE=renormalize, E_PAD=triton.next_power_of_2(logits.shape[1]),
                 K_PAD=triton.next_power_of_2(top_k))
    return _down(h, down, ids, row_weights, down_scale, tokens, top_k, config)


def _gate_up(x: torch.Tensor, gate_up: torch.Tensor, ids: torch.Tensor, row_weights: torch.Tensor,
             scale: torch.Tensor | None, top_k: int, config: GemvConfig, logits: torch.Tensor | None = None,
             **route) -> torch.Tensor:
    # [T * top_k, 2I]: each assignment's gate and up rows
    rows = ids.numel()
    h = torch.empty(rows, gate_up.shape[1], dtype=x.dtype, device=x.device)
    _launch(_expert_gemv_kernel, (rows, triton.cdiv(gate_up.shape[1], config.block_n)), x, gate_up, ids,
            row_weights, scale, h, gate_up.shape[2], config, logits,
            TOP_K=top_k, A_PER_TOKEN=True, A_SWIGLU=False, MUL_WEIGHT=False, **route)
    return h


def _down(h: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, row_weights: torch.Tensor,
          scale: torch.Tensor | None, tokens: int, top_k: int, config: GemvConfig) -> torch.Tensor:
    # [T, H]: the down products of silu(g) * u, weighted and summed per token
    hidden, inter = down.shape[1], down.shape[2]
    if config.fuse_combine:
        out = torch.empty(tokens, hidden, dtype=h.dtype, device=h.device)
        _launch(_expert_gemv_combine_kernel, (tokens, triton.cdiv(hidden, config.block_n)), h, down, ids,
                row_weights, scale, out, inter, config, TOP_K=top_k)
        return out
    rows = torch.empty(tokens * top_k, hidden, dtype=h.dtype, device=h.device)
    _launch(_expert_gemv_kernel, (tokens * top_k, triton.cdiv(hidden, config.block_n)), h, down, ids,
            row_weights, scale, rows, inter, config,
            TOP_K=top_k, A_PER_TOKEN=False, A_SWIGLU=True, MUL_WEIGHT=True)
    return combine(rows, tokens, top_k)
