"""The token-to-expert sort of a MoE layer on the GPU (`align_to_blocks`): the T x top_k (token, expert)
assignments sorted by expert, each expert's run padded to a multiple of BLOCK_M rows, so that a block of
BLOCK_M sorted rows belongs to one expert (fused_moe.py's grouped GEMM multiplies one block by one
expert's weight tile). Within an expert, assignments keep their flat order (token-major). Shapes are
fixed by (T, top_k, experts, BLOCK_M) alone and nothing is read back to the host, so the sort is captured
in CUDA graphs. Padding rows carry the index T * top_k; blocks past the last expert's run carry expert
-1 (their programs return at once), so at one token only the top_k chosen experts' weights are read.

Three ways, one result: up to ALIGN_KERNEL_MAX assignments (decode steps) one kernel whose programs each
count every assignment (`_align_kernel`); beyond, two kernels (`_chunk_counts_kernel`: each program's
chunk counted per expert; `_place_kernel`: each program sums the counts of the chunks before its own and
places its chunk); and torch's ops (`align_to_blocks_torch`: the reference the tests hold the kernels
to, and an empty batch's sort).

Only imported on GPU paths or under TRITON_INTERPRET=1 (tests/engine/test_fused_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.kernels.pdl import release_dependents, small_kernel_launch_options, wait_for_inputs


@dataclass(frozen=True)
class BlockAlignment:
    """The (token, slot) assignments sorted by expert in BLOCK_M-row groups (align_to_blocks).

    sorted_rows: [padded] int32, flat assignment index t * top_k + k of each sorted row, or T * top_k for
    a padding row. block_expert: [padded / BLOCK_M] int32, the expert of each block, -1 past the last run.
    """

    sorted_rows: torch.Tensor
    block_expert: torch.Tensor
    block_m: int


def padded_rows(assignments: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted buffer: every assignment plus, for each expert that can be hit, at most
    block_m - 1 padding rows; a multiple of block_m."""
    most = assignments + min(num_experts, assignments) * (block_m - 1)
    return triton.cdiv(most, block_m) * block_m


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """Sort the assignments of topk_ids [T, top_k] (expert ids) by expert, each expert's run padded to
    block_m rows; within an expert, assignments keep their flat order (token-major). Device work of
    fixed shapes only (no host sync): one kernel (`_align_kernel`, its programs side by side) up to
    ALIGN_KERNEL_MAX assignments (decode steps), two beyond (`align_to_blocks_chunked`); the same result
    as torch's sort (`align_to_blocks_torch`)."""
    n = topk_ids.numel()
    if n == 0:
        return align_to_blocks_torch(topk_ids, num_experts, block_m)
    if n > ALIGN_KERNEL_MAX:
        return align_to_blocks_chunked(topk_ids, num_experts, block_m)
    total = padded_rows(n, num_experts, block_m)
    sorted_rows = torch.empty(total, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(total // block_m, dtype=torch.int32, device=topk_ids.device)
    _align_kernel[(triton.cdiv(total, ALIGN_CHUNK),)](
        topk_ids.reshape(-1), sorted_rows, block_expert, n, total, num_experts,
        N_PAD=max(triton.next_power_of_2(n), ALIGN_CHUNK), E_PAD=triton.next_power_of_2(num_experts),
        BLOCK_M=block_m, CHUNK=ALIGN_CHUNK, **small_kernel_launch_options())
    return BlockAlignment(sorted_rows, block_expert, block_m)


# Each program of the sort owns ALIGN_CHUNK assignments and ALIGN_CHUNK rows of the sorted buffer, and
# counts every assignment itself (a [chunk, experts] one-hot per ALIGN_CHUNK of them) and compares its own
# with all n: the work per program grows with n, so beyond ALIGN_KERNEL_MAX (32 decode tokens at top-8)
# the two-kernel sort takes over. (One program doing everything serialised the whole sort, and torch's
# sort with its twenty launches took a prefill layer longer than its products: BENCHMARKS.md,
# Qwen3-VL-30B-A3B.)
ALIGN_CHUNK = 64
ALIGN_KERNEL_MAX = 256


@triton.jit
def _align_kernel(ids_ptr, sorted_rows_ptr, block_expert_ptr, n, total, num_experts,
                  N_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """align_to_blocks, program p: count each expert's assignments and pad the counts to BLOCK_M (every
    program alike), then give assignments p*CHUNK.. their rows (their expert's start + how many of that
    expert's come before them in flat order), and rows p*CHUNK.. that no assignment takes the index n,
    each block starting there its expert (-1 past the last run)."""
    wait_for_inputs()  # launched early (pdl.py): the router's ids are read after the wait
    release_dependents()
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, n, CHUNK):
        idx = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + idx, mask=idx < n, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    mine = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    if tl.program_id(0) * CHUNK < n:
        ids = tl.load(ids_ptr + mine, mask=mine < n, other=-1).to(tl.int32)
        every = tl.arange(0, N_PAD)
        all_ids = tl.load(ids_ptr + every, mask=every < n, other=-2).to(tl.int32)
        earlier = (all_ids[None, :] == ids[:, None]) & (every[None, :] < mine[:, None])
        before = tl.sum(earlier.to(tl.int32), axis=1)  # same-expert assignments earlier in flat order
        hot = (ids[:, None] == experts[None, :]).to(tl.int32)
        dest = tl.sum(hot * starts[None, :], axis=1) + before
        tl.store(sorted_rows_ptr + dest, mine.to(tl.int32), mask=mine < n)
    # the padding rows and the blocks' experts among this program's rows (disjoint from the rows above)
    _pad_rows(mine, ends, starts, counts, experts, num_experts, n, total, sorted_rows_ptr, block_expert_ptr,
              BLOCK_M)


@triton.jit
def _pad_rows(row, ends, run_start, counts, experts, num_experts, n, total, sorted_rows_ptr,
              block_expert_ptr, BLOCK_M: tl.constexpr):
    """For the sorted buffer's rows `row` (a vector): the index n in each one no assignment takes (past its
    expert's count within the expert's padded run), and in each row that starts a block, the block's
    expert (-1 past the last run). ends / run_start / counts: per expert, [E_PAD]."""
    live = experts < num_experts
    expert = tl.sum(((ends[None, :] <= row[:, None]) & live[None, :]).to(tl.int32), axis=1)
    owned = (expert[:, None] == experts[None, :]).to(tl.int32)
    first = tl.sum(owned * run_start[None, :], axis=1)
    count = tl.sum(owned * counts[None, :], axis=1)
    is_pad = (row - first >= count) | (expert >= num_experts)
    tl.store(sorted_rows_ptr + row, tl.zeros_like(row) + n, mask=(row < total) & is_pad)
    owner = tl.where(expert < num_experts, expert, -1)
    tl.store(block_expert_ptr + row // BLOCK_M, owner, mask=(row % BLOCK_M == 0) & (row < total))


def expert_order(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order: the flat assignment indices grouped by expert, flat order within (a stable sort); counts
    [experts] int64: each expert's assignments) of flat int64 expert ids. Device ops only (bincount would
    read its maximum back to the host)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return torch.sort(flat, stable=True).indices, counts


def align_to_blocks_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """align_to_blocks in torch ops (a stable sort by expert; fixed shapes, no host sync)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    order, counts = expert_order(flat, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    expert = flat[order]
    dest = padded_start[expert] + torch.arange(n, device=device) - count_start[expert]
    total = padded_rows(n, num_experts, block_m)
    sorted_rows = torch.full((total,), n, dtype=torch.int32, device=device)
    sorted_rows[dest] = order.to(torch.int32)
    block_start = torch.arange(0, total, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return BlockAlignment(sorted_rows, block_expert, block_m)


# The two-kernel sort: SORT_CHUNK assignments per program, counted and ranked in SUB-row pieces (a
# [SUB, experts] one-hot and a [SUB, SORT_CHUNK] comparison at a time), the chunks' counts read back in
# pieces of COUNT_ROWS chunks.
SORT_CHUNK = 256
SUB = 64
COUNT_ROWS = 64
# Rows of the sorted buffer (padding included) per placement program at most: with large blocks and few
# assignments, a handful of chunks' programs wrote thousands of padding rows each (BENCHMARKS.md,
# Qwen3-VL-30B-A3B).
PAD_ROWS_PER_PROGRAM = 512


def align_to_blocks_chunked(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockAlignment:
    """align_to_blocks for any number of assignments in two launches: `_chunk_counts_kernel` counts each
    SORT_CHUNK-assignment chunk's experts ([chunks, experts] int32), then `_place_kernel`'s program p
    sums the counts of all chunks (each expert's padded run) and of the chunks before p (where its
    chunk's assignments of each expert start within the run), places its chunk and writes its share of
    the padding rows and the blocks' experts."""
    return _sort_in_chunks(topk_ids, num_experts, block_m)[0]


def expert_runs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T * top_k] int32: the flat assignment indices grouped by expert, flat order within, as
    `expert_order`'s; ends [experts] int32: where each expert's run ends in that order) of topk_ids
    [T, top_k]: the two-kernel sort with one-row blocks (no padding), then the chunks' counts summed.
    Four launches, device work only."""
    alignment, counts = _sort_in_chunks(topk_ids, num_experts, 1)
    return alignment.sorted_rows, counts.sum(0, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _sort_in_chunks(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[BlockAlignment, torch.Tensor]:
    # align_to_blocks_chunked's sort, with the chunks' counts [chunks, experts] int32
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    total = padded_rows(n, num_experts, block_m)
    chunks = triton.cdiv(n, SORT_CHUNK)
    counts = torch.empty(chunks, num_experts, dtype=torch.int32, device=flat.device)
    sorted_rows = torch.empty(total, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(total // block_m, dtype=torch.int32, device=flat.device)
    e_pad = triton.next_power_of_2(num_experts)
    _chunk_counts_kernel[(chunks,)](flat, counts, n, num_experts, E_PAD=e_pad, CHUNK=SORT_CHUNK, SUB=SUB,
                                    **small_kernel_launch_options())
    # the padding rows are shared out over more programs than there are chunks where they are many (large
    # blocks, few assignments): the programs past the last chunk only write padding rows and blocks' experts
    programs = max(chunks, triton.cdiv(total, PAD_ROWS_PER_PROGRAM))
    rows_per_program = triton.cdiv(triton.cdiv(total, programs), SUB) * SUB
    _place_kernel[(programs,)](flat, counts, sorted_rows, block_expert, n, total, num_experts, chunks,
                               rows_per_program, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=SORT_CHUNK, SUB=SUB,
                               COUNT_ROWS=COUNT_ROWS, **small_kernel_launch_options())
    return BlockAlignment(sorted_rows, block_expert, block_m), counts


@triton.jit
def _chunk_counts_kernel(ids_ptr, counts_ptr, n, num_experts, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                         SUB: tl.constexpr):
    """counts[p, e]: assignments of chunk p (CHUNK of them) routed to expert e. Programs: chunks."""
    wait_for_inputs()  # launched early (pdl.py): the router's ids are read after the wait
    release_dependents()
    p = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for sub in tl.static_range(CHUNK // SUB):
        idx = p * CHUNK + sub * SUB + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + idx, mask=idx < n, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + p * num_experts + experts, counts, mask=experts < num_experts)


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, sorted_rows_ptr, block_expert_ptr, n, total, num_experts, chunks,
                  rows_per_program, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  SUB: tl.constexpr, COUNT_ROWS: tl.constexpr):
    """Program p: each expert's count (all chunks) and its count in the chunks before p, from counts;
    then chunk p's assignments (none for p >= chunks) at their expert's padded start + the earlier
    chunks' count + their rank among the chunk's assignments of that expert (flat order); then rows
    p * rows_per_program.. of the sorted buffer: the padding rows no assignment takes get n, and each
    block starting there its expert (-1 past the last run). Programs: at least chunks."""
    wait_for_inputs()  # launched early (pdl.py): the chunks' counts are read after the wait
    release_dependents()
    p = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    live = experts < num_experts
    every = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    for first in range(0, chunks, COUNT_ROWS):
        rows = first + tl.arange(0, COUNT_ROWS)
        block = tl.load(counts_ptr + rows[:, None] * num_experts + experts[None, :],
                        mask=(rows < chunks)[:, None] & live[None, :], other=0)
        every += tl.sum(block, axis=0)
        before += tl.sum(tl.where((rows < p)[:, None], block, 0), axis=0)
    padded = (every + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded + before  # where this chunk's assignments of each expert begin
    chunk = p * CHUNK + tl.arange(0, CHUNK)
    chunk_ids = tl.load(ids_ptr + chunk, mask=chunk < n, other=-2).to(tl.int32)
    for sub in tl.static_range(CHUNK // SUB):
        mine = p * CHUNK + sub * SUB + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + mine, mask=mine < n, other=-1).to(tl.int32)
        earlier = (chunk_ids[None, :] == ids[:, None]) & (chunk[None, :] < mine[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        hot = (ids[:, None] == experts[None, :]).to(tl.int32)
        dest = tl.sum(hot * starts[None, :], axis=1) + rank
        tl.store(sorted_rows_ptr + dest, mine.to(tl.int32), mask=mine < n)
    run_start = ends - padded
    for row0 in range(p * rows_per_program, (p + 1) * rows_per_program, SUB):
        _pad_rows(row0 + tl.arange(0, SUB), ends, run_start, every, experts, num_experts, n, total,
                  sorted_rows_ptr, block_expert_ptr, BLOCK_M)
