"""The Gated DeltaNet layer's GPU path: fla-core's (flash-linear-attention, Triton) gated delta rule over a
step's rows and the state pool's slots, beside the torch reference (model/gated_deltanet.py).

Which path a layer takes (`kernels_for`): MMSERVE_LINEAR_ATTENTION = auto (default: fla on a CUDA device when
`fla` imports, else the torch reference), torch (the reference everywhere), or fla (fla, or an error naming
what is missing: no CUDA device, or fla not importable).

`forward_packed` is the layer's step over fla's calling convention (`DeltaRuleKernels`):
- prefill chunks: one chunked call over all of the step's chunks packed as [1, T_total, H, D] with
  cu_seqlens, each sequence's initial state gathered from its slot (zeros where the chunk starts its
  sequence) and its final state written back to the slot. fla gives no state at inner positions, so a chunk
  with snapshots is cut there: call r runs the r-th piece of every chunk that has one, from the states
  call r - 1 left (one call when no chunk asks for a snapshot). The convolution is one depthwise conv1d
  over the chunks laid side by side, each after its K - 1 carried inputs; the conv state at any position
  is read from those columns, so it needs no cut.
- decode rows (one token each): the conv window from the slots, then fla's fused recurrent step from the
  slots' states (gathered; fla 0.4 has no in-place slot indices), both written back by index_copy_. No host
  synchronisation and no shape that depends on data: the slots are a device tensor, so a CUDA graph may
  capture the step with the slot tensor and the pool as its inputs.

Conventions are the reference's (and HF's when it hands this layer to fla): q and k L2-normalised in the
kernel (`use_qk_l2norm_in_kernel`), q scaled by Dk^-0.5, g the log decay in fp32, beta = sigmoid(b), the
recurrent state fp32 [N, Hv, Dk, Dv]. fla's fused recurrent rule serves Hv / Hk value heads from each key
head itself (value head h reads key head h // (Hv / Hk), repeat_interleave's order); its chunked rule (0.4)
wants equal heads, so q and k are repeated to the value heads first.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from decoder_svc.model.gated_deltanet import GatedDeltaNetShape, LinearStateStep

log = logging.getLogger("mmserve.decoder.linear_attention")

KERNEL_ENV = "MMSERVE_LINEAR_ATTENTION"
AUTO = "auto"
MODES = (AUTO, "torch", "fla")


@dataclass(frozen=True)
class DeltaRuleKernels:
    """The gated delta rule in fla's calling convention, chunked and recurrent alike:
    f(q [B, T, Hk, Dk], k [B, T, Hk, Dk], v [B, T, Hv, Dv], *, g [B, T, Hv], beta [B, T, Hv], scale,
    initial_state [N, Hv, Dk, Dv] fp32, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens [N + 1]
    int64 or None) -> (o [B, T, Hv, Dv], final state [N, Hv, Dk, Dv] fp32). With cu_seqlens, B = 1 and the
    N sequences lie side by side along T. `chunk` may require Hk == Hv (fla 0.4's does). Everything after
    v goes by keyword: fla's recurrent rule has gk and gv between g and beta."""

    chunk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    recurrent: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    name: str = "fla"


def linear_attention_mode(mode: str | None = None) -> str:
    """The mode asked for: `mode`, else MMSERVE_LINEAR_ATTENTION, else auto."""
    mode = (mode or os.environ.get(KERNEL_ENV) or AUTO).strip().lower()
    if mode not in MODES:
        raise ValueError(f"{KERNEL_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


@functools.cache
def load_fla() -> tuple[DeltaRuleKernels | None, str]:
    """fla's two rules, or (None, why they do not import). Imported once per process."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as exc:  # ImportError, or Triton failing at import on a host without a driver
        return None, f"{type(exc).__name__}: {exc}"
    return DeltaRuleKernels(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule), ""


_logged: set[tuple[str, str]] = set()


def kernels_for(device: torch.device, mode: str | None = None,
                load: Callable[[], tuple[DeltaRuleKernels | None, str]] = load_fla
                ) -> DeltaRuleKernels | None:
    """The kernels a layer on `device` takes (None: the torch reference), by `linear_attention_mode(mode)`.
    Raises RuntimeError when fla is asked for and cannot run: no CUDA device, or fla not importable."""
    mode = linear_attention_mode(mode)
    if mode == "torch":
        return None
    if device.type != "cuda":
        if mode == "fla":
            raise RuntimeError(f"{KERNEL_ENV}=fla needs a CUDA device (fla's kernels are Triton GPU "
                               f"kernels); this layer runs on {device}. Use auto or torch here.")
        return None
    kernels, why = load()
    if kernels is None and mode == "fla":
        raise RuntimeError(f"{KERNEL_ENV}=fla but fla (the fla-core package) does not import: {why}")
    key = (mode, why)
    if key not in _logged:
        _logged.add(key)
        log.info("Gated DeltaNet layers: %s", "fla kernels" if kernels is not None
                 else f"the torch reference (fla does not import: {why})")
    return kernels


@dataclass(frozen=True)
class PrefillRound:
    """One chunked call: the r-th piece of every chunk that has one, side by side. `positions` are packed
    rows (the step's chunk rows in chunk order), `chunks` the pieces' chunk indices, `ends` how many of its
    chunk's tokens each piece ends after, `cu_seqlens` the pieces' bounds within the call."""

    positions: list[int]
    chunks: list[int]
    ends: list[int]
    cu_seqlens: list[int]


@dataclass(frozen=True)
class PrefillPlan:
    """Where a step's prefill chunks go (host lists; model/linear_state.py's LinearChunk for a chunk).

    Packed rows: the chunks' rows one after another (`rows`: the step's row of each). Conv columns: chunk
    i's K - 1 carried inputs at [offsets[i], offsets[i] + K - 1), then its rows; `columns` says where each
    column comes from (j < carried: the j-th carried input, flattened chunk by chunk; else packed row
    j - carried), `conv_out` which output of a conv1d without padding each packed row takes."""

    rows: list[int]
    offsets: list[int]
    columns: list[int]
    carried: int
    conv_out: list[int]
    rounds: list[PrefillRound]

    @classmethod
    def of(cls, chunks: tuple, taps: int) -> PrefillPlan:
        """The plan of chunks (first_row, end_row, snapshots) for a convolution of `taps` taps."""
        carry = taps - 1
        rows, offsets, columns, conv_out, cuts = [], [], [], [], []
        carried = carry * len(chunks)
        column = 0
        for i, c in enumerate(chunks):
            n, packed = c.end_row - c.first_row, len(rows)
            offsets.append(column)
            columns += range(i * carry, (i + 1) * carry)
            columns += range(carried + packed, carried + packed + n)
            conv_out += range(column, column + n)
            rows += range(c.first_row, c.end_row)
            cuts.append(sorted({k for k, _ in c.snapshots} | {n}))
            column += carry + n
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + c.end_row - c.first_row)
        rounds = []
        for r in range(max((len(ends) for ends in cuts), default=0)):
            positions, members, ends, cu = [], [], [], [0]
            for i, chunk_cuts in enumerate(cuts):
                if r < len(chunk_cuts):
                    lo = chunk_cuts[r - 1] if r else 0
                    positions += range(starts[i] + lo, starts[i] + chunk_cuts[r])
                    members.append(i)
                    ends.append(chunk_cuts[r])
                    cu.append(len(positions))
            rounds.append(PrefillRound(positions, members, ends, cu))
        return cls(rows, offsets, columns, carried, conv_out, rounds)


def _index(values: list[int], device: torch.device) -> torch.Tensor | slice:
    """values as an index: a slice when they are consecutive (no gather), else a device tensor."""
    if values and values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return torch.tensor(values, dtype=torch.long, device=device)


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _split_heads(mixed: torch.Tensor, shape: GatedDeltaNetShape) -> tuple[torch.Tensor, ...]:
    """Convolved rows [..., conv_dim] -> q, k [..., Hk, Dk], v [..., Hv, Dv]."""
    q, k, v = torch.split(mixed, [shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
    lead = mixed.shape[:-1]
    return (q.reshape(*lead, shape.num_k_heads, shape.head_k_dim),
            k.reshape(*lead, shape.num_k_heads, shape.head_k_dim),
            v.reshape(*lead, shape.num_v_heads, shape.head_v_dim))


def forward_packed(qkv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, conv_weight: torch.Tensor,
                   shape: GatedDeltaNetShape, step: LinearStateStep, layer: int, kernels: DeltaRuleKernels
                   ) -> torch.Tensor:
    """The layer's token mixing over a step's rows with `kernels`: qkv [N, conv_dim] (in_proj_qkv's
    outputs), beta [N, Hv], g [N, Hv] fp32, conv_weight [conv_dim, K] -> o [N, Hv, Dv] (before the gated
    norm) in qkv's dtype; the pool's slots of `layer` (and the snapshot slots asked for) left holding the
    states after the step, as the reference's forward_batch leaves them."""
    o = qkv.new_empty(qkv.shape[0], shape.num_v_heads, shape.head_v_dim)
    conv_pool, rec_pool = step.pool.conv[layer], step.pool.recurrent[layer]
    if step.decode_rows is not None:
        _decode(qkv, beta, g, conv_weight, shape, step.decode_rows, step.decode_slots, conv_pool, rec_pool,
                kernels, o)
    if step.chunks:
        _prefill(qkv, beta, g, conv_weight, shape, step.chunks, conv_pool, rec_pool, kernels, o)
    return o


def _decode(qkv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, weight: torch.Tensor,
            shape: GatedDeltaNetShape, rows: torch.Tensor, slots: torch.Tensor, conv_pool: torch.Tensor,
            rec_pool: torch.Tensor, kernels: DeltaRuleKernels, o: torch.Tensor) -> None:
    """One token per slot: gathers and index_copy_ only (CUDA-graph safe)."""
    token = qkv.index_select(0, rows).to(conv_pool.dtype)[..., None]
    window = torch.cat([conv_pool.index_select(0, slots), token], dim=-1)  # [B, C, K]: carried, then this
    mixed = F.silu((window.float() * weight.float()).sum(-1)).to(qkv.dtype)  # K taps summed in fp32
    conv_pool.index_copy_(0, slots, window[:, :, 1:])
    q, k, v = (t[:, None] for t in _split_heads(mixed, shape))  # [B, 1, H, D]
    out, final = kernels.recurrent(
        q, k, v, g=g.index_select(0, rows)[:, None], beta=beta.index_select(0, rows)[:, None],
        scale=shape.head_k_dim ** -0.5, initial_state=rec_pool.index_select(0, slots),
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=None)
    rec_pool.index_copy_(0, slots, final.to(rec_pool.dtype))
    o.index_copy_(0, rows, out[:, 0].to(o.dtype))


def _prefill(qkv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, weight: torch.Tensor,
             shape: GatedDeltaNetShape, chunks: tuple, conv_pool: torch.Tensor, rec_pool: torch.Tensor,
             kernels: DeltaRuleKernels, o: torch.Tensor) -> None:
    """Every chunk of the step: one packed convolution, then one chunked call per round of pieces."""
    device, taps = qkv.device, weight.shape[-1]
    plan = PrefillPlan.of(chunks, taps)
    slots = _long([c.slot for c in chunks], device)
    fresh = [i for i, c in enumerate(chunks) if c.fresh]
    rows = _index(plan.rows, device)

    # The convolution: carried inputs (zeros for fresh chunks) and rows side by side, one conv1d.
    carried = conv_pool.index_select(0, slots)  # [M, C, K - 1]
    if fresh:
        carried.index_fill_(0, _long(fresh, device), 0)
    x = qkv[rows].to(conv_pool.dtype)  # [P, C]
    source = torch.cat([carried.permute(1, 0, 2).reshape(carried.shape[1], -1), x.t()], dim=1)
    columns = source[:, _long(plan.columns, device)]  # [C, L]
    conv = F.conv1d(columns[None].to(weight.dtype), weight[:, None], groups=weight.shape[0])[0]
    mixed = F.silu(conv[:, _long(plan.conv_out, device)].t()).to(qkv.dtype)  # [P, C]
    q, k, v = _split_heads(mixed, shape)
    groups = shape.num_v_heads // shape.num_k_heads
    if groups > 1:  # fla 0.4's chunked rule: one key head per value head
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    beta, g = beta[rows], g[rows]

    packed = o.new_empty(len(plan.rows), shape.num_v_heads, shape.head_v_dim)
    state = rec_pool.index_select(0, slots)  # [M, Hv, Dk, Dv] fp32
    if fresh:
        state.index_fill_(0, _long(fresh, device), 0)
    previous: list[int] = list(range(len(chunks)))  # the chunks the state's rows belong to
    for rnd in plan.rounds:
        if rnd.chunks != previous:  # some chunks ended last round: keep the others' states
            state = state.index_select(0, _long([previous.index(i) for i in rnd.chunks], device))
        at = _index(rnd.positions, device)
        out, state = kernels.chunk(
            q[at][None], k[at][None], v[at][None], g=g[at][None], beta=beta[at][None],
            scale=shape.head_k_dim ** -0.5, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=_long(rnd.cu_seqlens, device))
        packed[at] = out[0].to(packed.dtype)
        _store(rnd, chunks, plan, state, columns, conv_pool, rec_pool, taps - 1)
        previous = rnd.chunks
    o[rows] = packed


def _store(rnd: PrefillRound, chunks: tuple, plan: PrefillPlan, state: torch.Tensor, columns: torch.Tensor,
           conv_pool: torch.Tensor, rec_pool: torch.Tensor, carry: int) -> None:
    """The states after a round's pieces into the slots that ask for them: snapshot slots at their
    positions, the chunk's own slot after its last piece."""
    sources, starts, dsts = [], [], []
    for j, (i, end) in enumerate(zip(rnd.chunks, rnd.ends, strict=True)):
        c = chunks[i]
        targets = [s for k, s in c.snapshots if k == end]
        if end == c.end_row - c.first_row:
            targets.append(c.slot)
        for slot in targets:
            sources.append(j)
            starts.append(plan.offsets[i] + end)  # the K - 1 inputs before this position
            dsts.append(slot)
    if not dsts:
        return
    device = state.device
    dst = _long(dsts, device)
    rec_pool.index_copy_(0, dst, state.index_select(0, _long(sources, device)).to(rec_pool.dtype))
    window = _long(starts, device)[:, None] + torch.arange(carry, device=device)  # [S, K - 1]
    conv_pool.index_copy_(0, dst, columns[:, window].permute(1, 0, 2).to(conv_pool.dtype))
