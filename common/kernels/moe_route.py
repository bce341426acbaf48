"""A mixture-of-experts router's choice on the GPU in one kernel: softmax in fp32 over each token's router
logits, the top_k largest probabilities, renormalised to sum to one when asked, cast to the logits' dtype.

It replaces the chain of torch launches of decoder_svc/model/moe.py's `route` (softmax, topk's sort,
the renormalising sum and division, two casts) and returns the same values: the top_k in descending
order, ties taken lowest expert first (torch.topk documents no order among ties). The exponentials are
Triton's, so a probability may differ from torch's in its last fp32 bits; a weight rounded to bf16 then
differs in rare cases by one bf16 ulp. Fixed shapes, no host sync: capturable in CUDA graphs.

Only imported on GPU paths or under TRITON_INTERPRET=1 (tests/engine/test_fused_moe.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.pdl import release_dependents, small_kernel_launch_options, wait_for_inputs

# tokens per program: BLOCK_T x next_power_of_2(experts) probabilities in registers
BLOCK_T = 16


@triton.jit
def top_k_of(x, live, TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
    """(probabilities, experts), each [rows, K_PAD] (slots TOP_K.. zero), of fp32 logits x [rows, E_PAD]
    whose columns `live` are experts: softmax over the live columns, the TOP_K largest in descending
    order, ties lowest expert first, renormalised to sum to one when RENORMALIZE."""
    E_PAD: tl.constexpr = x.shape[1]
    experts = tl.arange(0, E_PAD)
    x = tl.where(live[None, :], x, -float("inf"))
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = e / tl.sum(e, axis=1)[:, None]
    probs = tl.where(live[None, :], probs, -1.0)  # below every probability: never chosen
    slots = tl.arange(0, K_PAD)
    chosen_p = tl.zeros((x.shape[0], K_PAD), dtype=tl.float32)  # slots TOP_K.. stay 0
    chosen_e = tl.zeros((x.shape[0], K_PAD), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        best_e = tl.min(tl.where(probs == best[:, None], experts[None, :], E_PAD), axis=1)
        chosen_p = tl.where(slots[None, :] == k, best[:, None], chosen_p)
        chosen_e = tl.where(slots[None, :] == k, best_e[:, None], chosen_e)
        probs = tl.where(experts[None, :] == best_e[:, None], -2.0, probs)
    if RENORMALIZE:
        chosen_p = chosen_p / tl.sum(chosen_p, axis=1)[:, None]
    return chosen_p, chosen_e


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, tokens, num_experts, stride_t,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_T: tl.constexpr, E_PAD: tl.constexpr):
    """Programs: tokens / BLOCK_T. weights [tokens, TOP_K] (logits' dtype), ids [tokens, TOP_K] int32."""
    wait_for_inputs()  # launched early (pdl.py): the logits are read after the wait
    release_dependents()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, E_PAD)
    row_ok = rows < tokens
    live = experts < num_experts
    x = tl.load(logits_ptr + rows[:, None] * stride_t + experts[None, :],
                mask=row_ok[:, None] & live[None, :], other=-float("inf")).to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # rows past the last token: finite, never stored
    chosen_p, chosen_e = top_k_of(x, live, TOP_K, K_PAD, RENORMALIZE)
    slots = tl.arange(0, K_PAD)
    out = rows[:, None] * TOP_K + slots[None, :]
    ok = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, chosen_p.to(weights_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + out, chosen_e, mask=ok)


def check_logits(logits: torch.Tensor, top_k: int) -> None:
    """Raise ValueError unless logits are [tokens, experts] with contiguous rows and 0 < top_k <= experts."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"router logits must be [tokens, experts] with contiguous rows, got "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"top_k {top_k} of {logits.shape[1]} experts")


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in logits' dtype, expert ids [T, top_k] int32) of router logits [T, experts]:
    decoder_svc/model/moe.py's `route` in one launch."""
    check_logits(logits, top_k)
    tokens, num_experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(triton.cdiv(tokens, BLOCK_T),)](
            logits, weights, ids, tokens, num_experts, logits.stride(0), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, BLOCK_T=BLOCK_T,
            E_PAD=triton.next_power_of_2(num_experts), **small_kernel_launch_options())
    return weights, ids
