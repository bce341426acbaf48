"""Triton attention over the paged KV cache: one kernel for a flat varlen batch in which prefill chunks
(causal within the chunk, full view of the cached prefix) and decode rows share a launch. The new K/V
go into the cache first (kv_store.py: as they are, or rotated by the same kernel that rotates q);
a decode step may leave that to this kernel (DecodeRotary: q rotated in registers, and the program whose
keys end with the new key rotates and stores it and the value before reading), one launch fewer.

Layout. Each program takes BLOCK_M query rows of one KV head: BLOCK_Q consecutive tokens of one
sequence times the H_PER_KV query heads that share that KV head (GQA packed along the rows), so each
key/value tile is read once for all of them. Programs are numbered flat over the batch; a program finds
its sequence by binary search over `query_start_loc` (sequence i owns q-blocks starting at
query_start_loc[i] // BLOCK_Q + i), so the grid needs no host-side table and a CUDA graph can replay it
with new lengths. A third grid axis splits the keys (split-KV) when a few sequences alone would leave
most of the GPU idle; a small second kernel merges the partial softmaxes.

Masks (the torch reference's, decoder_svc/model/attention.py). A row at position p sees keys <= p, or
<= key_limits[row] when the metadata has key limits (Gemma 3's bidirectional image blocks), and with a
sliding `window` only keys > p - window. A program walks the key tiles from the window start of its
first row (tiles wholly below every row's window are skipped) to the largest limit among its rows
(causal: its last row's position); the splits divide that range. A row may see no key of a split (or
of a tile): its partial max stays -inf and the merge gives it weight 0. Both features are constexpr
switches (HAS_WINDOW, HAS_LIMITS): without them the kernel's body is the causal one (the limits pointer
and the window are passed but never read). A window must hold at least one key (window >= 1).

Nothing here syncs with the host: the host passes only the grid (an upper bound) and block shapes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl

from common.kernels.elementwise import RotaryLaunch, cos_sin_halves, rotate_pair
from common.kernels.kv_store import check_kv, store_rotated_kv
from common.kernels.pdl import release_dependents, small_kernel_launch_options, wait_for_inputs

_LOG2E = 1.4426950408889634
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension
HEADS_FIRST = os.environ.get("MMSERVE_ATTENTION_HEADS_FIRST", "1") != "0"


class PagedBatch(Protocol):
    """What the launch reads of a batch's layout (the decoder's AttentionMetadata,
    decoder_svc/model/attention.py, is one): per sequence its context length, where its query rows
    start and its block table, the longest chunk, and optionally per row the last key it may see."""

    @property
    def num_seqs(self) -> int: ...
    @property
    def max_query_len(self) -> int: ...  # 1: decode only
    @property
    def seq_lens(self) -> torch.Tensor: ...  # [num_seqs] int32
    @property
    def query_start_loc(self) -> torch.Tensor: ...  # [num_seqs + 1] int32
    @property
    def block_tables(self) -> torch.Tensor: ...  # [num_seqs, max_blocks] int32
    @property
    def key_limits(self) -> torch.Tensor | None: ...  # [tokens] int32, or None: causal


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first q-block (query_start_loc[i] // BLOCK_Q + i) is <= q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# num_seqs is not specialised: Triton would compile a variant for 1, for multiples of 16 and for the rest,
# and the first eager step of 2-15 sequences (a burst's first mixed prefill) stalled ~1.2 s compiling.
# num_seqs and num_splits are runtime values that Triton must not specialise on (== 1, % 16): every
# specialisation is one more compile (1-2 s at head_dim 256) the first time a step meets it.
@triton.jit
def _rotated_query(q_ptr, q_rows, head, row_ok, cos, sin, stride_qt, stride_qh, half,
                   BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # The query tile [BLOCK_M, 2 * half] rotated in registers (TritonOps.rotary's rounding); q in memory
    # is left as it was.
    dh = tl.arange(0, BLOCK_HALF)
    mask = row_ok[:, None] & (dh < half)[None, :]
    base = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dh[None, :]
    q1, q2 = rotate_pair(tl.load(base, mask=mask, other=0.0), tl.load(base + half, mask=mask, other=0.0),
                         cos, sin, q_ptr.dtype.element_ty)
    return tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_M, 2 * BLOCK_HALF))


@triton.jit
def _store_rotated_key(new_k_ptr, new_v_ptr, k_cache_ptr, v_cache_ptr, slot, token, kv_head, cos, sin,
                       stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_cb, stride_cr, stride_ch, half,
                       PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    # This step's key (rotated) and value of one KV head into the cache at `slot` (< 0: nothing).
    dh = tl.arange(0, BLOCK_HALF)[None, :]
    d = tl.arange(0, BLOCK_D)
    k_row = new_k_ptr + token * stride_nkt + kv_head * stride_nkh
    k1 = tl.load(k_row + dh, mask=dh < half, other=0.0)
    k2 = tl.load(k_row + half + dh, mask=dh < half, other=0.0)
    v = tl.load(new_v_ptr + token * stride_nvt + kv_head * stride_nvh + d, mask=d < HEAD_DIM, other=0.0)
    k1, k2 = rotate_pair(k1, k2, cos, sin, new_k_ptr.dtype.element_ty)
    store_rotated_kv(k_cache_ptr, v_cache_ptr, slot, kv_head, k1, k2, v, dh < half, d < HEAD_DIM, dh, d, half,
                     PAGE, stride_cb, stride_cr, stride_ch)


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_acc_ptr, part_ml_ptr, key_limits_ptr, scale_log2, num_seqs, window, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cr, stride_ch, stride_bt,
    new_k_ptr, new_v_ptr, positions_ptr, cos_sin_ptr, slot_ptr, stride_nkt, stride_nkh, stride_nvt,
    stride_nvh, cos_sin_stride, half,
    NUM_HEADS: tl.constexpr, H_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_LIMITS: tl.constexpr,
    DECODE: tl.constexpr, ROTATE: tl.constexpr = False, BLOCK_HALF: tl.constexpr = 1,
    HEADS_FIRST: tl.constexpr = False,
):
    wait_for_inputs()
    release_dependents()
    if HEADS_FIRST:  # the grid is (KV heads, q-blocks, splits): a sequence's heads run side by side
        kv_head = tl.program_id(0)
        q_block = tl.program_id(1)
    else:
        q_block = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        # Every sequence has one query row, token i of sequence i (paged_attention checks the shapes): no
        # search and no query_start_loc loads, which at one row are most of this kernel's latency.
        seq = q_block
        q_start = q_block
        local_block = q_block * 0  # 0 and 1 as int32 tensors, as the loads give them on the other path
        q_len = local_block + 1
        seq_len = tl.load(seq_lens_ptr + seq)
    else:
        seq = _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)  # with the two above: one round of loads
        local_block = q_block - (q_start // BLOCK_Q + seq)
        if local_block * BLOCK_Q >= q_len:  # the grid is an upper bound: spare programs stop here
            return
    context = seq_len - q_len  # tokens already in the cache before this step's chunk

    m = tl.arange(0, BLOCK_M)
    tok = local_block * BLOCK_Q + m // H_PER_KV
    head = kv_head * H_PER_KV + m % H_PER_KV
    row_ok = (m < BLOCK_Q * H_PER_KV) & (tok < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    if ROTATE:  # a decode step's rotary embedding and KV store done here (rotate_and_forward)
        pos = tl.load(positions_ptr + seq).to(tl.int64)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        dh = tl.arange(0, BLOCK_HALF)
        cos, sin = cos_sin_halves(cos_sin_ptr, pos, cos_sin_stride, half, dh, dh < half,
                                  q_ptr.dtype.element_ty)
        q = _rotated_query(q_ptr, q_rows, head, row_ok, cos, sin, stride_qt, stride_qh, half, BLOCK_M,
                           BLOCK_HALF)
    else:
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context + tok  # each query sees keys 0..q_pos (causal)

    if HAS_LIMITS:  # ..key_limits[row] instead (an image's tokens see the whole image)
        last = tl.load(key_limits_ptr + q_rows, mask=row_ok, other=0)
        # The tile's keys run to its rows' largest limit (never past the sequence's keys).
        num_keys = tl.minimum(tl.max(tl.where(row_ok, last + 1, 0), 0), seq_len.to(tl.int64)).to(tl.int32)
    else:
        last = q_pos
        num_keys = context + tl.minimum((local_block + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(num_keys, BLOCK_N)
    if HAS_WINDOW:  # keys > q_pos - window: skip the tiles below the tile's first row's window
        tile_start = tl.maximum(context + local_block * BLOCK_Q - window + 1, 0) // BLOCK_N
        tile_start = tl.minimum(tile_start, num_tiles)
    else:
        tile_start = 0
    per_split = tl.cdiv(num_tiles - tile_start, num_splits)
    tile_lo = tile_start + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    if ROTATE:
        # The program whose keys end with this step's key stores it (and its value) first; the barrier
        # makes the stores visible to its own loads below. The other splits never read that key.
        if (num_tiles > tile_lo) & (num_tiles <= tile_hi):
            _store_rotated_key(new_k_ptr, new_v_ptr, k_cache_ptr, v_cache_ptr, slot, seq.to(tl.int64),
                               kv_head, cos, sin, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_cb,
                               stride_cr, stride_ch, half, PAGE, HEAD_DIM, BLOCK_HALF, BLOCK_D)
            tl.debug_barrier()

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < num_keys
        block = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        offs = block * stride_cb + (n % PAGE) * stride_cr + kv_head * stride_ch
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        visible = (n[None, :] <= last[:, None]) & n_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a padded row (seq_len 0) attends to nothing: zeros
        o = acc / l_safe[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (q_rows * NUM_HEADS + head) * num_splits + split  # [tokens, heads, splits] row index
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_ml_ptr, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr):
    wait_for_inputs()
    release_dependents()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * NUM_HEADS + head) * NUM_SPLITS
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    # All three loads before any use: one round of memory latency, not two.
    m = tl.load(part_ml_ptr + (base + s) * 2)
    lse = tl.load(part_ml_ptr + (base + s) * 2 + 1)
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * BLOCK_D + d[None, :])
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # empty splits have m = -inf: weight 0
    total = tl.sum(lse * w, 0)
    total = tl.where(total == 0.0, 1.0, total)
    o = tl.sum(acc * w[:, None], 0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def row_tiles(max_query_len: int, h_per_kv: int, invariant: bool = False) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): query rows per program, and the tokens they are (times h_per_kv heads).
    Decode-heavy batches use 16-row tiles (the smallest a tensor-core dot takes), prefill 64; `invariant`:
    64 whatever the batch (another tile size may take another tensor-core instruction)."""
    block_m = 16 if max_query_len * h_per_kv <= 16 and not invariant else 64
    block_m = max(block_m, triton.next_power_of_2(h_per_kv))
    return block_m, block_m // h_per_kv


@dataclass(frozen=True)
class AttentionTiles:
    """Keys per tile of the attention loop, the launch's warps and pipeline stages, and the programs'
    order (bench.attention sweeps them; `for_head_dim` is what the decoder launches).

    heads_first: the grid is (KV heads, q-blocks, splits), so the programs of one sequence's heads are
    dispatched together. The cache is [blocks, page, KV heads, head dim]: one key's heads are one
    contiguous row (8 KB at 32 heads of 128), so heads read side by side cover whole rows where programs
    ordered by sequence read 256 bytes of each row at a time, rows of many sequences apart.
    `MMSERVE_ATTENTION_HEADS_FIRST=0` dispatches by sequence (the order before; the A/B)."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    heads_first: bool = True

    @staticmethod
    def for_head_dim(head_dim: int) -> AttentionTiles:
        """64 keys a tile up to head dim 128, 32 beyond (a tile's K and V grow with the head dim), 4 warps,
        2 stages: the decoder's launch."""
        return AttentionTiles(64 if head_dim <= 128 else 32, heads_first=HEADS_FIRST)


@dataclass(frozen=True)
class DecodeRotary:
    """A decode step's new keys and values, not yet rotated nor stored, with their rotary inputs:
    paged_attention then rotates q in registers and has each sequence's last-key program rotate its key
    and store it and the value before reading the keys (one launch a layer instead of two)."""

    k: torch.Tensor  # [T, Hk, D], contiguous head dim; left as it is
    v: torch.Tensor  # [T, Hk, D]
    slot_mapping: torch.Tensor  # [T]; < 0: not stored (a graph's padded row)
    rot: RotaryLaunch  # positions, the cos|sin table, half = D / 2

    @staticmethod
    def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                meta: PagedBatch) -> bool:
        """Whether a step can take it: decode only (one row per sequence), full rotary over a head dim
        that is a power of two (the rotated halves rejoin as the query tile), contiguous head dims, no
        key limits."""
        head_dim = q.shape[-1]
        return (meta.max_query_len == 1 and q.shape[0] == meta.num_seqs and meta.key_limits is None
                and cos_sin.shape[-1] == head_dim and head_dim >= 16 and head_dim & (head_dim - 1) == 0
                and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: PagedBatch, scale: float,
                    num_splits: int = 1, out: torch.Tensor | None = None,
                    window: int | None = None, rotary: DecodeRotary | None = None,
                    tiles: AttentionTiles | None = None, invariant: bool = False) -> torch.Tensor:
    """Attention of every query row [tokens, heads, head_dim] over its sequence's paged K/V.

    num_splits > 1 divides each sequence's keys among that many programs (then merges them): worth it
    when num_seqs * kv_heads programs alone would leave most multiprocessors idle. With `window`, a
    query at position p sees keys > p - window only; with meta.key_limits, row t sees keys up to
    key_limits[t] instead of up to its own position (both: p - window < key <= key_limits[t]).
    With `rotary` (decode steps, DecodeRotary.applies) q is unrotated and this step's keys and values
    are not in the cache yet: the kernel rotates and stores them. `tiles` overrides the key tile, warps
    and stages (benchmarks; default `AttentionTiles.for_head_dim`). `invariant` (the decoder's
    deterministic mode): one row tile and one program layout for every batch, keys never split, so a
    row's result is the same bits whatever its chunk and its batch (tiles past its keys add exact zeros).
    """
    if invariant and (num_splits != 1 or rotary is not None):
        raise ValueError("invariant attention takes one split and no rotary in the kernel")
    tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q) if out is None else out
    if tokens == 0:
        return out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    kv_heads = k_cache.shape[2]
    h_per_kv = num_heads // kv_heads
    block_m, block_q = row_tiles(meta.max_query_len, h_per_kv, invariant)
    block_d = triton.next_power_of_2(max(head_dim, 16))
    num_seqs = meta.num_seqs
    limits = meta.key_limits  # None: causal (the kernel without the limit loads)
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must hold at least one key, not {window}")
    # A decode-only batch (one row per sequence, row i of sequence i) takes one program per sequence and
    # head, which find their rows without a search.
    decode = meta.max_query_len == 1 and tokens == num_seqs and not invariant
    if rotary is not None:
        if not DecodeRotary.applies(q, rotary.k, rotary.v, rotary.rot.cache, meta):
            raise ValueError("rotary in attention takes decode steps of full rotary over a power-of-two "
                             "head dim with contiguous heads and no key limits")
        check_kv(rotary.k, rotary.v, kv_cache, rotary.slot_mapping)
        new_k, new_v, positions, table, slots = (rotary.k, rotary.v, rotary.rot.positions, rotary.rot.cache,
                                                 rotary.slot_mapping)
    else:  # unused stand-ins
        new_k, new_v, positions, table, slots = q, q, meta.seq_lens, q, meta.seq_lens
    tiles = tiles or AttentionTiles.for_head_dim(head_dim)
    q_blocks = num_seqs if decode else tokens // block_q + num_seqs
    heads_first = tiles.heads_first and q_blocks <= _MAX_GRID_Y  # else the q-blocks take the long axis
    grid = (kv_heads, q_blocks, num_splits) if heads_first else (q_blocks, kv_heads, num_splits)
    if num_splits > 1:
        part_acc = torch.empty(tokens * num_heads * num_splits, block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(tokens * num_heads * num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        part_acc, part_ml, meta.seq_lens if limits is None else limits, scale * _LOG2E, num_seqs,
        0 if window is None else window, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        new_k, new_v, positions, table, slots, new_k.stride(0), new_k.stride(1), new_v.stride(0),
        new_v.stride(1), table.stride(0), head_dim // 2,
        NUM_HEADS=num_heads, H_PER_KV=h_per_kv, HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=tiles.block_n,
        SPLIT=num_splits > 1, IEEE=q.dtype == torch.float32, HAS_WINDOW=window is not None,
        HAS_LIMITS=limits is not None, DECODE=decode, ROTATE=rotary is not None,
        BLOCK_HALF=max(head_dim // 2, 1), HEADS_FIRST=heads_first, enable_fp_fusion=rotary is None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **small_kernel_launch_options())
    if num_splits > 1:
        _merge_splits_kernel[(tokens, num_heads)](
            out, part_acc, part_ml, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            **small_kernel_launch_options())
    return out
