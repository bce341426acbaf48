"""The gated delta rule token by token, each sequence's recurrent state updated where it lies in a pool of
state slots (a hybrid stack's decode rows and short prefill pieces: decoder_svc/model/gated_deltanet_fla.py).

fla's fused recurrent step takes the states as one batch tensor and returns new ones: gathering the rows'
slots before it and writing them back after it reads and writes every state three times. Here each
program reads its slot's state tile once, runs its sequence's tokens over it and writes it back once. A
short prefill piece (a warm request's few uncached tokens) runs here too: one launch with its sequence
bounds on the device, where fla's chunked rule makes a dozen launches and a host synchronisation.

Per sequence b, value head h (its key head h // (Hv / Hk)), per token in order, in fp32, as the torch
reference (decoder_svc/model/gated_deltanet.py's recurrent_gated_delta_rule, HF's
torch_recurrent_gated_delta_rule): q, k L2-normalised (eps 1e-6; or given normalised), q scaled;
S = S * exp(g); delta = (v - k @ S) * beta; S = S + k^T delta; o = q @ S. One program per (sequence, value
head, block of value dims): the state's key dim whole.

Only imported on GPU paths or under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 32  # value dims per program: a [Dk, 32] fp32 tile of the state (16 KiB at Dk = 128); 16 where
# the value dim is an odd multiple of 16


@triton.jit
def _delta_rule_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, cu_ptr,
                                 fresh_ptr, snap_rows_ptr, snap_slots_ptr, out_ptr, scale, eps, num_v_heads,
                                 groups,
                                 q_stride, k_stride, v_stride, gate_stride, out_stride,
                                 DK: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                                 VARLEN: tl.constexpr, NORMALIZE: tl.constexpr, FRESH: tl.constexpr,
                                 SNAPSHOT: tl.constexpr):
    seq_head = tl.program_id(0)
    seq = seq_head // num_v_heads
    head = seq_head % num_v_heads
    key_head = head // groups
    dk = tl.arange(0, DK)
    dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    if VARLEN:  # the sequence's rows [cu[seq], cu[seq + 1])
        first = tl.load(cu_ptr + seq).to(tl.int32)
        end = tl.load(cu_ptr + seq + 1).to(tl.int32)
    else:  # one row per sequence
        first = seq
        end = seq + 1

    slot = tl.load(slots_ptr + seq).to(tl.int64)
    tile = state_ptr + ((slot * num_v_heads + head) * DK + dk[:, None]) * DV + dv[None, :]
    # an empty sequence (a CUDA graph's unused one) leaves its slot alone; a fresh one starts from zeros
    keep = end > first
    if FRESH:
        read = keep & (tl.load(fresh_ptr + seq) == 0)
    else:
        read = keep
    s = tl.load(tile, mask=(dk[:, None] >= 0) & read, other=0.0)
    if SNAPSHOT:  # the state after row snap_row (-1: none) is copied into the snapshot slot as well
        snap_row = tl.load(snap_rows_ptr + seq).to(tl.int32)
        snap_slot = tl.load(snap_slots_ptr + seq).to(tl.int64)
        snap_tile = state_ptr + ((snap_slot * num_v_heads + head) * DK + dk[:, None]) * DV + dv[None, :]
    for row in range(first, end):
        q = tl.load(q_ptr + row * q_stride + key_head * DK + dk).to(tl.float32)
        k = tl.load(k_ptr + row * k_stride + key_head * DK + dk).to(tl.float32)
        if NORMALIZE:
            q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + eps))
            k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps))
        q = q * scale
        v = tl.load(v_ptr + row * v_stride + head * DV + dv).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + row * gate_stride + head).to(tl.float32))
        beta = tl.load(beta_ptr + row * gate_stride + head).to(tl.float32)
        s = s * decay
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + row * out_stride + head * DV + dv, o.to(out_ptr.dtype.element_ty))
        if SNAPSHOT:
            tl.store(snap_tile, s, mask=(dk[:, None] >= 0) & (row == snap_row))
    tl.store(tile, s, mask=(dk[:, None] >= 0) & keep)


def supports(head_k_dim: int, head_v_dim: int) -> bool:
    """Whether the kernel takes these head dims (a power-of-two key dim, value dims in blocks of 16)."""
    return head_k_dim >= 16 and head_k_dim & (head_k_dim - 1) == 0 and head_v_dim % 16 == 0


def delta_rule_recurrent_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, scale: float,
                          out: torch.Tensor, cu_seqlens: torch.Tensor | None = None, normalize: bool = True,
                          eps: float = 1e-6, fresh: torch.Tensor | None = None,
                          snapshot_rows: torch.Tensor | None = None,
                          snapshot_slots: torch.Tensor | None = None) -> None:
    """Rows q, k [N, Hk, Dk]; v [N, Hv, Dv]; g (log decay), beta [N, Hv]; state_pool [S, Hv, Dk, Dv] fp32,
    contiguous; out [N, Hv, Dv] (any float dtype) takes each row's output. Without cu_seqlens every row is
    one sequence's one token; with it [B + 1] (int, on the device) sequence b is rows [cu[b], cu[b + 1]) in
    order. Sequence b's state is state_pool[slots[b]] (distinct slots; an empty sequence's slot is neither
    read nor written, so several may share one), updated in place; with `fresh` (int [B] on the device),
    a sequence whose entry is nonzero starts from a zero state instead of its slot's; with
    `snapshot_rows` (int [B]: a row of the sequence, or -1) and `snapshot_slots` ([B]) the state after that
    row is also written to state_pool[snapshot_slots[b]] (a slot no sequence runs in). `normalize`:
    L2-normalise q and k here (False: they are). Each tensor's last dim contiguous; g and beta share
    strides."""
    rows, num_v_heads, head_v_dim = v.shape
    head_k_dim = q.shape[-1]
    sequences = rows if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if rows == 0 or sequences == 0:
        return
    if not supports(head_k_dim, head_v_dim):
        raise ValueError(f"head dims {head_k_dim}/{head_v_dim}: the key dim a power of two >= 16, the value "
                         "dim a multiple of 16")
    if state_pool.dtype != torch.float32 or not state_pool.is_contiguous():
        raise ValueError("the state pool must be contiguous fp32")
    if state_pool.shape[1:] != (num_v_heads, head_k_dim, head_v_dim):
        raise ValueError(f"state pool {tuple(state_pool.shape)} does not hold [Hv, Dk, Dv] = "
                         f"{(num_v_heads, head_k_dim, head_v_dim)} states")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError(f"{name}'s heads must lie contiguously in a row (strides {t.stride()})")
    if g.stride() != beta.stride() or g.stride(-1) != 1:
        raise ValueError("g and beta need the same strides and a contiguous last dim")
    snapshots = snapshot_rows is not None
    if snapshots != (snapshot_slots is not None) or (snapshots and cu_seqlens is None):
        raise ValueError("snapshot_rows and snapshot_slots go together, with cu_seqlens")
    groups = num_v_heads // q.shape[1]
    block = BLOCK_V if head_v_dim % BLOCK_V == 0 else 16
    _delta_rule_recurrent_kernel[(sequences * num_v_heads, head_v_dim // block)](
        q, k, v, g, beta, state_pool, slots, slots if cu_seqlens is None else cu_seqlens,
        slots if fresh is None else fresh, slots if snapshot_rows is None else snapshot_rows,
        slots if snapshot_slots is None else snapshot_slots, out, scale, eps,
        num_v_heads, groups, q.stride(0), k.stride(0), v.stride(0), g.stride(0), out.stride(0),
        DK=head_k_dim, DV=head_v_dim, BLOCK_DV=block, VARLEN=cu_seqlens is not None, NORMALIZE=normalize,
        FRESH=fresh is not None, SNAPSHOT=snapshot_rows is not None, num_warps=4)
