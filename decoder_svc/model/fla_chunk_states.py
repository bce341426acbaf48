"""fla's chunked gated delta rule, also giving the state at the start of each of its 64-token chunks.

fla-core 0.4's chunked rule computes, for every 64-token chunk of every sequence, the recurrent state the
chunk starts from (its kernel `chunk_gated_delta_rule_fwd_kernel_h_blockdim64` keeps it in fp32 registers
and stores it, in the inputs' dtype, for the output kernel), and returns only the final state. A prefill
that needs the state at an inner position (a snapshot for prefix reuse) was therefore cut there and
called the rule once per piece, each call a dozen launches and their host work per layer.

`chunk_with_states` runs fla's forward pipeline itself (the same functions, in the same order, as
`chunk_gated_delta_rule_fwd`) with the states stored in fp32: the state at a chunk boundary is the value the
kernel carries there, bit for bit the final state a call cut at that boundary would return (the chunks
are the same, relative to the sequence's start). The output kernel reads the states cast to the inputs'
dtype, as fla's own store casts them, so `o` is fla's too.

Calling convention as DeltaRuleKernels' `chunk` (q and k normalised by the caller, cu_seqlens given,
B = 1), plus the states: (o [1, T, H, Dv], final [N, H, Dk, Dv] fp32, states [chunks, H, Dk, Dv] fp32, one
per chunk in fla's order: sequence by sequence, each's ceil(length / 64) chunks from its start).
"""

from __future__ import annotations

import torch


def chunk_with_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor,
                      beta: torch.Tensor, scale: float, initial_state: torch.Tensor | None,
                      cu_seqlens: torch.Tensor, chunk_size: int = 64
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    import triton
    from fla.ops.common import chunk_delta_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum, solve_tril

    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    g = chunk_local_cumsum(g, chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    a = chunk_scaled_dot_kkt_fwd(k=k, g=g, beta=beta, cu_seqlens=cu_seqlens, output_dtype=torch.float32)
    a = solve_tril(A=a, cu_seqlens=cu_seqlens, output_dtype=k.dtype)
    w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=a, g=g, cu_seqlens=cu_seqlens)

    # chunk_gated_delta_rule_fwd_h, its states allocated in fp32 (the kernel stores in its pointer's dtype)
    _, _, heads, dk, dv = *k.shape, u.shape[-1]
    n = cu_seqlens.shape[0] - 1
    num_chunks = chunk_delta_h.prepare_chunk_indices(cu_seqlens, chunk_size).shape[0]
    offsets = chunk_delta_h.prepare_chunk_offsets(cu_seqlens, chunk_size)
    states = k.new_empty(1, num_chunks, heads, dk, dv, dtype=torch.float32)
    final = k.new_empty(n, heads, dk, dv, dtype=torch.float32)
    v_new = torch.empty_like(u)

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(dv, meta["BV"]), n * heads

    chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64[grid](
        k=k, v=u, w=w, v_new=v_new, g=g, gk=None, h=states, h0=initial_state, ht=final,
        cu_seqlens=cu_seqlens, chunk_offsets=offsets, T=k.shape[1], H=heads, K=dk, V=dv, BT=chunk_size)
    h = states if states.dtype == k.dtype else states.to(k.dtype)
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=cu_seqlens)
    return o.to(q.dtype), final, states[0]
