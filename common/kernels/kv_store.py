"""Writing a step's new keys and values into the paged KV cache, in Triton: as they are (`store_kv`), or
rotated on the way in (`rotary_store_kv`: the rotary embedding of q and k and the K/V store in one
kernel, one launch a layer fewer than rotary then store).

The cache is [2, num_blocks, block_size, kv_heads, head_dim] (decoder_svc/model/attention.py); a token's
slot is block * block_size + row, and a slot < 0 (a CUDA graph's padding row) stores nothing. The rotation
is TritonOps.rotary's (elementwise.py: HF's rounding points, partial rotary), so the fused kernel writes
the same bits into the cache as rotary followed by store_kv.

Only imported on GPU paths or under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.elementwise import RotaryLaunch, cos_sin_halves, rotate_pair
from common.kernels.pdl import release_dependents, small_kernel_launch_options, wait_for_inputs


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cr, stride_ch,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    wait_for_inputs()  # launched early (pdl.py): nothing is read before
    release_dependents()  # the next kernel may launch now and wait behind this one
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padded row (CUDA-graph bucket): nothing to store
        return
    block, row = slot // block_size, slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM)
    dst = block * stride_cb + row * stride_cr + h * stride_ch + d
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def store_rotated_kv(k_cache_ptr, v_cache_ptr, slot, heads, k1, k2, v, halves, whole, dh, d, half, block_size,
                     stride_cb, stride_cr, stride_ch):
    """Store rotated key halves k1, k2 (at dims dh and half + dh, where `halves`) and the value v (at dims d,
    where `whole`) of `heads` at cache `slot`; a slot < 0 (a graph's padded row) stores nothing. Returns
    (the heads' offset in the cache, whether the slot is kept) for stores of further dims."""
    keep = slot >= 0
    at = tl.where(keep, slot, 0)
    dst = (at // block_size) * stride_cb + (at % block_size) * stride_cr + heads * stride_ch
    tl.store(k_cache_ptr + dst + dh, k1, mask=halves & keep)
    tl.store(k_cache_ptr + dst + half + dh, k2, mask=halves & keep)
    tl.store(v_cache_ptr + dst + d, v, mask=whole & keep)
    return dst, keep


@triton.jit
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                            block_size, q_s_tok, q_s_head, k_s_tok, k_s_head, v_s_tok, v_s_head,
                            cos_sin_stride, stride_cb, stride_cr, stride_ch,
                            n_q_heads, half,
                            KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_QH: tl.constexpr,
                            BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per token: its cos/sin are loaded once for the q heads (rotated in place) and the k heads
    # (rotated in registers and stored at the slot with the values). At one token a step this kernel is
    # all latency, so the loads come in two dependent rounds: the position and the slot, then everything
    # else (q, k and v first, as they need neither; then cos/sin). All loads precede every store (q and k
    # may be views of one buffer: a store would hold the loads after it back), and a padded row (slot < 0)
    # masks its cache stores rather than branching around loads.
    wait_for_inputs()
    release_dependents()
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    half_dims = tl.arange(0, BLOCK_HALF)
    d = half_dims[None, :]
    d_mask = d < half
    q_heads = tl.arange(0, BLOCK_QH)[:, None]
    q_halves = (q_heads < n_q_heads) & d_mask
    q1_ptrs = q_ptr + tok * q_s_tok + q_heads * q_s_head + d  # the head dim is contiguous (checked)
    q2_ptrs = q1_ptrs + half
    q1 = tl.load(q1_ptrs, mask=q_halves, other=0.0)
    q2 = tl.load(q2_ptrs, mask=q_halves, other=0.0)
    heads = tl.arange(0, BLOCK_KH)[:, None]
    h_ok = heads < KV_HEADS
    k_row = k_ptr + tok * k_s_tok + heads * k_s_head
    halves = h_ok & d_mask
    k1 = tl.load(k_row + d, mask=halves, other=0.0)
    k2 = tl.load(k_row + half + d, mask=halves, other=0.0)
    e = tl.arange(0, BLOCK_D)[None, :]
    whole = h_ok & (e < HEAD_DIM)
    rest = whole & (e >= 2 * half)  # past the table's width (partial rotary): as they are
    k_rest = tl.load(k_row + e, mask=rest, other=0.0)
    v = tl.load(v_ptr + tok * v_s_tok + heads * v_s_head + e, mask=whole, other=0.0)
    dtype = q_ptr.dtype.element_ty
    cos, sin = cos_sin_halves(cos_sin_ptr, pos, cos_sin_stride, half, half_dims, half_dims < half, dtype)

    q1, q2 = rotate_pair(q1, q2, cos, sin, dtype)
    tl.store(q1_ptrs, q1, mask=q_halves)
    tl.store(q2_ptrs, q2, mask=q_halves)
    k1, k2 = rotate_pair(k1, k2, cos, sin, dtype)
    dst, keep = store_rotated_kv(k_cache_ptr, v_cache_ptr, slot, heads, k1, k2, v, halves, whole, d, e, half,
                                 block_size, stride_cb, stride_cr, stride_ch)
    tl.store(k_cache_ptr + dst + e, k_rest, mask=rest & keep)


def check_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Raise ValueError unless k and v [T, Hk, D] fit the cache [2, blocks, block_size, Hk, D] (k's dtype,
    a contiguous last dim) and slot_mapping holds one slot per token: what the kernels that store K/V
    index by."""
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"k and v must match, got {tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != tuple(k.shape[1:]):
        raise ValueError(f"kv_cache [2, blocks, block_size, {k.shape[1]}, {k.shape[2]}] expected, got "
                         f"{tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1 or kv_cache.dtype != k.dtype:
        raise ValueError("kv_cache must have k's dtype and a contiguous last dim")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V [tokens, kv_heads, head_dim] at its slot; slots < 0 are skipped."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), **small_kernel_launch_options())


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """TritonOps.rotary(q, k, positions, cos_sin_cache), then store_kv(k, v, ...), in one kernel.

    q [T, Hq, D] is rotated IN PLACE (it may be a view of a fused qkv buffer); k [T, Hk, D] is rotated on
    its way into the cache and left as it was (the cache holds the keys from here on); v is stored as it
    is. All three need a contiguous head dim. Raises ValueError on shapes the kernel cannot take.
    """
    rot = RotaryLaunch.of(q, k, positions, cos_sin_cache)
    check_kv(k, v, kv_cache, slot_mapping)
    if not (q.stride(-1) == k.stride(-1) == v.stride(-1) == 1):
        raise ValueError("q, k and v need a contiguous head dim (TritonOps.rotary takes any strides)")
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _rotary_store_kv_kernel[(tokens,)](
        q, k, v, rot.positions, rot.cache, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), rot.cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), q.shape[1], rot.half,
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_QH=rot.block_qh, BLOCK_KH=rot.block_kh,
        BLOCK_HALF=rot.block_half, BLOCK_D=triton.next_power_of_2(head_dim), **rot.options(),
        **small_kernel_launch_options())
