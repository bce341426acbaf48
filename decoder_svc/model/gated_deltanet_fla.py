"""The Gated DeltaNet layer's GPU path: fla-core's (flash-linear-attention, Triton) gated delta rule over a
step's rows and the state pool's slots, beside the torch reference (model/gated_deltanet.py).

Which path a layer takes (`kernels_for`): MMSERVE_LINEAR_ATTENTION = auto (default: fla on a CUDA device when
`fla` imports, else the torch reference), torch (the reference everywhere), or fla (fla, or an error naming
what is missing: no CUDA device, or fla not importable).

`forward_packed` is the layer's step over fla's calling convention (`DeltaRuleKernels`):
- prefill chunks: one chunked call over all of the step's chunks packed as [1, T_total, H, D] with
  cu_seqlens, each sequence's initial state gathered from its slot (zeros where the chunk starts its
  sequence) and its final state written back to the slot. A snapshot a whole number of fla's 64-token
  chunks after a piece's start is read from the states fla's chunked pipeline computes at its chunk
  bounds (`chunk_states`, fla_chunk_states.py: the same values a call ending there would return); a chunk
  with a snapshot elsewhere is cut there: call r runs the r-th piece of every chunk that has one, from
  the states call r - 1 left (one call when every snapshot falls on a chunk bound; the engine places them
  so, engine/state_snapshots.py). The convolution is one depthwise conv1d
  over the chunks laid side by side, each after its K - 1 carried inputs; the conv state at any position
  is read from those columns, so it needs no cut. The plan's index tensors go to the device once per step
  (cached by the step's chunks), not once per layer.
  A round whose pieces are all short (at most SHORT_PIECE tokens, one of fla's chunks: a warm request's
  uncached tail, a prompt's last piece after its last snapshot) runs the rule token by token in one launch
  instead (`recurrent_in_place`, below), without fla's dozen launches and host synchronisation.
- decode rows (one token each): the conv window from the slots (written back by index_copy_), then the
  recurrent step on the slots' states in place (`recurrent_in_place`:
  common/kernels/delta_rule_recurrent.py, each state read and written once) or, where that kernel does not
  take the head dims, fla's fused recurrent step over the gathered states (fla 0.4 has no slot indices),
  written back. No host synchronisation and no shape that depends on data: the slots are a device tensor,
  so a CUDA graph may capture the step with the slot tensor and the pool as its inputs.

Conventions are the reference's (and HF's when it hands this layer to fla): q and k L2-normalised (by the
recurrent kernels themselves; before the chunked rule, whose l2norm kernel compiles per row count), q
scaled by Dk^-0.5, g the log decay in fp32, beta = sigmoid(b), the
recurrent state fp32 [N, Hv, Dk, Dv]. fla's fused recurrent rule serves Hv / Hk value heads from each key
head itself (value head h reads key head h // (Hv / Hk), repeat_interleave's order); its chunked rule (0.4)
wants equal heads, so q and k are repeated to the value heads first.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from decoder_svc.model.fla_indices import chunk_indices, chunk_offsets, seed
from decoder_svc.model.fla_indices import install as install_seeded_indices
from decoder_svc.model.linear_state import SHORT_PIECE, conv_source_codes

if TYPE_CHECKING:
    from decoder_svc.model.gated_deltanet_shape import GatedDeltaNetShape, LinearStateStep
    from decoder_svc.model.linear_state import LinearGraphRows

log = logging.getLogger("mmserve.decoder.linear_attention")

KERNEL_ENV = "MMSERVE_LINEAR_ATTENTION"
FLA_CHUNK = 64  # fla's chunked rule's block (its varlen indices are per block)
AUTO = "auto"
MODES = (AUTO, "torch", "fla")


@dataclass(frozen=True)
class DeltaRuleKernels:
    """The gated delta rule in fla's calling convention, chunked and recurrent alike:
    f(q [B, T, Hk, Dk], k [B, T, Hk, Dk], v [B, T, Hv, Dv], *, g [B, T, Hv], beta [B, T, Hv], scale,
    initial_state [N, Hv, Dk, Dv] fp32 (None: zeros), output_final_state, use_qk_l2norm_in_kernel,
    cu_seqlens [N + 1] int64 or None) -> (o [B, T, Hv, Dv], final state [N, Hv, Dk, Dv] fp32). With
    cu_seqlens, B = 1 and the N sequences lie side by side along T. `chunk` may require Hk == Hv (fla 0.4's
    does). Everything after v goes by keyword: fla's recurrent rule has gk and gv between g and beta."""

    chunk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    recurrent: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    name: str = "fla"
    # f(q [N, Hk, Dk], k, v [N, Hv, Dv], g [N, Hv], beta [N, Hv], state_pool, slots [B], scale, out,
    # cu_seqlens=None, normalize=True) -> None: the rule token by token, the slots' states updated in place
    # (delta_rule_recurrent_'s contract); None: decode through `recurrent`, every prefill through `chunk`
    recurrent_in_place: Callable[..., None] | None = None
    recurrent_supports: Callable[[int, int], bool] | None = None  # (Dk, Dv): does it take them
    # f(o [R, Dv], z [R, Dv], weight [Dv], eps) -> the layer's gated output norm in one launch (rows of one
    # head each; GatedRMSNorm's contract); None: the torch module
    gated_norm: Callable[..., torch.Tensor] | None = None
    # f(a [N, Hv], b [N, Hv], A_log, dt_bias) -> (beta, g): the gates in one launch; None: the torch ops
    gates: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # the prefill convolution over source codes (common/kernels/causal_conv.py's packed_causal_conv_,
    # gather_conv_windows_ and supports(channels, taps, head_dim)); None: torch's conv1d over gathered
    # columns
    causal_conv: Callable[..., None] | None = None
    conv_windows: Callable[..., None] | None = None
    conv_supports: Callable[[int, int, int], bool] | None = None
    # `chunk` over cu_seqlens (no final-state or l2norm flags) that also returns the states at the start of
    # each of its FLA_CHUNK-token chunks, fp32 [chunks, Hv, Dk, Dv] in fla's order (fla_chunk_states.py);
    # None: a snapshot inside a chunk cuts it into another call
    chunk_states: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None


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

        from common.kernels import causal_conv
        from common.kernels.delta_rule_recurrent import delta_rule_recurrent_, supports
        from common.kernels.elementwise import delta_gates, gated_rms_norm
        from decoder_svc.model.fla_chunk_states import chunk_with_states
    except Exception as exc:  # ImportError, or Triton failing at import on a host without a driver
        return None, f"{type(exc).__name__}: {exc}"
    install_seeded_indices()  # fla's chunk indices from the step's plan, not read back per call
    return DeltaRuleKernels(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
                            recurrent_in_place=delta_rule_recurrent_, recurrent_supports=supports,
                            gated_norm=gated_rms_norm, gates=delta_gates,
                            causal_conv=causal_conv.packed_causal_conv_,
                            conv_windows=causal_conv.gather_conv_windows_,
                            conv_supports=causal_conv.supports, chunk_states=chunk_with_states), ""


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
    chunk's tokens each piece ends after, `cu_seqlens` the pieces' bounds within the call; `keep` which of
    the previous call's final states start these pieces (None: all, in order). After the call the state
    after piece `sources[j]` goes to slot `dsts[j]` (a snapshot's, or the chunk's own after its last piece),
    its conv state read from the K - 1 conv columns from `starts[j]`. Snapshots inside a piece, where the
    rule gives the states at its chunk boundaries (`chunk_states`): the state at boundary `inner_sources[j]`
    (fla's chunk order over the call) goes to slot `inner_dsts[j]`, its conv state from `inner_starts[j]`."""

    positions: list[int]
    chunks: list[int]
    ends: list[int]
    cu_seqlens: list[int]
    keep: list[int] | None
    sources: list[int]
    starts: list[int]
    dsts: list[int]
    inner_sources: list[int] = field(default_factory=list)
    inner_starts: list[int] = field(default_factory=list)
    inner_dsts: list[int] = field(default_factory=list)


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
    def of(cls, chunks: tuple, taps: int, state_chunk: int = 0) -> PrefillPlan:
        """The plan of chunks (first_row, end_row, slot, snapshots) for a convolution of `taps` taps.
        `state_chunk` > 0: the chunked rule also gives the state every `state_chunk` tokens from a piece's
        start (DeltaRuleKernels.chunk_states), so a snapshot there is read from those states instead of
        cutting the chunk into another round."""
        carry = taps - 1
        rows, offsets, columns, conv_out, cuts, inner, starts = [], [], [], [], [], [], []
        carried = carry * len(chunks)
        column = 0
        for i, c in enumerate(chunks):
            n, packed = c.end_row - c.first_row, len(rows)
            offsets.append(column)
            starts.append(packed)
            columns += range(i * carry, (i + 1) * carry)
            columns += range(carried + packed, carried + packed + n)
            conv_out += range(column, column + n)
            rows += range(c.first_row, c.end_row)
            chunk_cuts, chunk_inner = _cuts(sorted({k for k, _ in c.snapshots}), n, state_chunk)
            cuts.append(chunk_cuts)
            inner.append(chunk_inner)
            column += carry + n
        rounds: list[PrefillRound] = []
        previous = list(range(len(chunks)))  # the chunks whose final states the last call gave
        for r in range(max((len(ends) for ends in cuts), default=0)):
            positions, members, ends, cu = [], [], [], [0]
            sources, window_starts, dsts = [], [], []
            inner_sources, inner_starts, inner_dsts = [], [], []
            boundaries = 0  # state chunks of the round's earlier pieces (fla's chunk order)
            for i, chunk_cuts in enumerate(cuts):
                if r >= len(chunk_cuts):
                    continue
                begin, end, c = chunk_cuts[r - 1] if r else 0, chunk_cuts[r], chunks[i]
                positions += range(starts[i] + begin, starts[i] + end)
                for k in (k for k in inner[i] if begin < k < end):
                    for slot in (slot for at, slot in c.snapshots if at == k):
                        inner_sources.append(boundaries + (k - begin) // state_chunk)
                        inner_starts.append(offsets[i] + k)
                        inner_dsts.append(slot)
                if state_chunk:
                    boundaries += -(-(end - begin) // state_chunk)
                targets = [slot for k, slot in c.snapshots if k == end]
                targets += [c.slot] if end == c.end_row - c.first_row else []
                for slot in targets:
                    sources.append(len(members))
                    window_starts.append(offsets[i] + end)  # the K - 1 inputs before this position
                    dsts.append(slot)
                members.append(i)
                ends.append(end)
                cu.append(len(positions))
            keep = None if members == previous else [previous.index(i) for i in members]
            rounds.append(PrefillRound(positions, members, ends, cu, keep, sources, window_starts, dsts,
                                       inner_sources, inner_starts, inner_dsts))
            previous = members
        return cls(rows, offsets, columns, carried, conv_out, rounds)


def _cuts(snapshots: list[int], n: int, state_chunk: int) -> tuple[list[int], list[int]]:
    """Where a chunk of n tokens with snapshots at these offsets (sorted) is cut, the end n included, and
    which snapshots its pieces' chunk states give instead (a whole number of `state_chunk`s after the start
    of the piece they fall in; none when state_chunk is 0)."""
    cuts, inner, begin = [], [], 0
    for k in snapshots:
        if k >= n:
            continue
        if state_chunk and k > begin and (k - begin) % state_chunk == 0:
            inner.append(k)
        else:
            cuts.append(k)
            begin = k
    return [*cuts, n], inner


@dataclass(frozen=True)
class _DeviceRound:
    """A PrefillRound's index tensors on the device."""

    at: torch.Tensor | slice
    cu_seqlens: torch.Tensor
    keep: torch.Tensor | None
    sources: torch.Tensor | None  # None also where every piece's state is stored, in order
    windows: torch.Tensor | None  # [S, K - 1] conv columns
    dsts: torch.Tensor | None
    longest: int  # tokens in the round's longest piece
    order: torch.Tensor  # arange(pieces): the pieces' rows of the running states
    # snapshots from the states at chunk boundaries (None: none in this round): which states, the K - 1
    # conv columns of each (torch's conv only), and their slots
    inner_sources: torch.Tensor | None = None
    inner_windows: torch.Tensor | None = None
    inner_dsts: torch.Tensor | None = None


@dataclass(frozen=True)
class _DevicePlan:
    """A step's PrefillPlan as device index tensors: made once per step, read by every linear layer."""

    rows: torch.Tensor | slice
    num_rows: int
    slots: torch.Tensor
    fresh: torch.Tensor | None
    all_fresh: bool  # every chunk starts its sequence
    # torch's convolution (None where the conv kernel runs): PrefillPlan's columns and conv_out
    columns: torch.Tensor | None
    conv_out: torch.Tensor | None
    rounds: tuple[_DeviceRound, ...]
    # the conv kernel's (None where torch's convolution runs):
    codes: torch.Tensor | None  # int32 [P, K]: where each packed row's conv inputs come from (conv_codes)
    window_codes: torch.Tensor | None  # int32 [S, K - 1]: the conv state of each slot the step writes ...
    window_dsts: torch.Tensor | None  # [S]: ... and those slots


class _Upload:
    """Index lists gathered for one host-to-device copy: on CUDA from pinned memory without waiting (a
    plain copy of each list would synchronise the host with the GPU once per list)."""

    def __init__(self) -> None:
        self.pieces: list[torch.Tensor] = []

    def add(self, values: list[int] | torch.Tensor) -> int:
        """Queue values (a list, or a host int64 tensor); returns their handle for `send`'s result."""
        self.pieces.append(torch.as_tensor(values, dtype=torch.long).flatten())
        return len(self.pieces) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """Every queued piece as a long tensor on `device`, by handle (views of one copy)."""
        host = torch.cat(self.pieces) if self.pieces else torch.empty(0, dtype=torch.long)
        if device.type == "cuda":
            # the copy reads the pinned buffer after this returns; torch's pinned-memory allocator keeps a
            # buffer used by a non-blocking copy from reuse until the copy is done
            sent = host.pin_memory().to(device, non_blocking=True)
        else:
            sent = host.to(device)
        return list(sent.split([piece.numel() for piece in self.pieces]))


@functools.lru_cache(maxsize=4)
def _device_plan(chunks: tuple, taps: int, device: torch.device, conv_kernel: bool, state_chunk: int = 0
                 ) -> _DevicePlan:
    # Keyed by the step's chunks (frozen dataclasses): the first linear layer of a step builds it, the
    # others find it, so a step copies its indices to the device once, in one copy. Only the indices of
    # the convolution that runs go: the kernel's source codes, or torch's columns (conv_kernel False).
    plan = PrefillPlan.of(chunks, taps, state_chunk)
    fresh = [i for i, c in enumerate(chunks) if c.fresh]
    up = _Upload()
    handles = {"slots": up.add([c.slot for c in chunks]), "fresh": up.add(fresh)}
    if not conv_kernel:
        handles.update(columns=up.add(plan.columns), conv_out=up.add(plan.conv_out))
    if not _consecutive(plan.rows):
        handles["rows"] = up.add(plan.rows)
    per_round = []
    for rnd in plan.rounds:
        lengths = [b - a for a, b in pairwise(rnd.cu_seqlens)]
        h = {"cu": up.add(rnd.cu_seqlens), "order": up.add(list(range(len(rnd.chunks)))),
             "chunk_indices": up.add([x for pair in chunk_indices(lengths, FLA_CHUNK) for x in pair]),
             "chunk_offsets": up.add(chunk_offsets(lengths, FLA_CHUNK))}
        if not _consecutive(rnd.positions):
            h["at"] = up.add(rnd.positions)
        if rnd.keep is not None:
            h["keep"] = up.add(rnd.keep)
        if rnd.dsts:  # the states written, and (torch's conv) the K - 1 conv columns of each
            if not conv_kernel:
                h["windows"] = up.add(_window_columns(rnd.starts, taps))
            h["dsts"] = up.add(rnd.dsts)
            if rnd.sources != list(range(len(rnd.chunks))):  # else the states go as they are
                h["sources"] = up.add(rnd.sources)
        if rnd.inner_dsts:
            h["inner_sources"], h["inner_dsts"] = up.add(rnd.inner_sources), up.add(rnd.inner_dsts)
            if not conv_kernel:
                h["inner_windows"] = up.add(_window_columns(rnd.inner_starts, taps))
        per_round.append(h)
    if conv_kernel:
        codes, window_codes, window_dsts = conv_codes(chunks, taps)
        handles.update(codes=up.add(codes), window_codes=up.add(window_codes),
                       window_dsts=up.add(window_dsts))
    sent = up.send(device)
    rounds = []
    for rnd, h in zip(plan.rounds, per_round, strict=True):
        cu = sent[h["cu"]]
        seed(cu, sent[h["chunk_indices"]].view(-1, 2), sent[h["chunk_offsets"]], FLA_CHUNK)
        rounds.append(_DeviceRound(
            sent[h["at"]] if "at" in h else _as_slice(rnd.positions), cu,
            sent[h["keep"]] if "keep" in h else None,
            sent[h["sources"]] if "sources" in h else None,
            sent[h["windows"]].view(-1, taps - 1) if "windows" in h else None,
            sent[h["dsts"]] if "dsts" in h else None,
            max(b - a for a, b in pairwise(rnd.cu_seqlens)), sent[h["order"]],
            sent[h["inner_sources"]] if "inner_sources" in h else None,
            sent[h["inner_windows"]].view(-1, taps - 1) if "inner_windows" in h else None,
            sent[h["inner_dsts"]] if "inner_dsts" in h else None))

    def took(name: str, shape: tuple[int, ...] = (-1,), dtype: torch.dtype = torch.long
             ) -> torch.Tensor | None:
        return sent[handles[name]].view(shape).to(dtype) if name in handles else None

    return _DevicePlan(took("rows") if "rows" in handles else _as_slice(plan.rows), len(plan.rows),
                       sent[handles["slots"]], took("fresh") if fresh else None, len(fresh) == len(chunks),
                       took("columns"), took("conv_out"), tuple(rounds),
                       took("codes", (-1, taps), torch.int32),
                       took("window_codes", (-1, taps - 1), torch.int32), took("window_dsts"))


def conv_codes(chunks: tuple, taps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The source codes of common/kernels/causal_conv.py for a step's chunks, over the step's rows and
    the layer's whole conv-state pool, as host int64 tensors: (codes [P * K], each packed row's K inputs,
    oldest first; window codes [S * (K - 1)], the K - 1 inputs before each position whose state the step
    keeps: a snapshot's, or the chunk's own after its last token; the S slots those go to)."""
    codes, windows, dsts = [], [], []
    for c in chunks:
        n = c.end_row - c.first_row
        rows, before = conv_source_codes(c.first_row, n, c.slot, c.fresh, [*(k for k, _ in c.snapshots), n],
                                         taps)
        codes.append(rows.ravel())
        windows.append(before.ravel())
        dsts += [slot for _, slot in c.snapshots] + [c.slot]
    if not chunks:
        return tuple(torch.empty(0, dtype=torch.long) for _ in range(3))
    return (torch.from_numpy(np.concatenate(codes)), torch.from_numpy(np.concatenate(windows)),
            torch.tensor(dsts, dtype=torch.long))


def _window_columns(starts: list[int], taps: int) -> list[int]:
    """The K - 1 conv columns from each start (torch's convolution: a state's carried inputs)."""
    return [start + j for start in starts for j in range(taps - 1)]


def _consecutive(values: list[int]) -> bool:
    return bool(values) and values == list(range(values[0], values[0] + len(values)))


def _as_slice(values: list[int]) -> slice:
    return slice(values[0], values[0] + len(values))


def _in_place(kernels: DeltaRuleKernels, shape: GatedDeltaNetShape) -> bool:
    """Whether the in-place recurrent kernel serves this layer's rows (it takes these head dims)."""
    return kernels.recurrent_in_place is not None and kernels.recurrent_supports(shape.head_k_dim,
                                                                                 shape.head_v_dim)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim in fp32, in x's dtype: what fla's in-kernel l2norm and the
    torch reference compute (gated_deltanet.l2norm, in the input's dtype; that module imports this one)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def _heads_in_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] with each row's heads side by side (what the in-place kernel reads): x itself where
    they are (the conv kernel's rows), else a copy (torch's conv gives a transposed view)."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


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
    if step.graph is not None:
        if not graph_rows_supported(kernels, shape):
            raise ValueError(f"a graph's step needs the in-place kernels, which {kernels.name} lacks here")
        _graph_rows(qkv, beta, g, conv_weight, shape, step.graph, conv_pool, rec_pool, kernels, o)
        return o
    if step.decode_rows is not None:
        _decode(qkv, beta, g, conv_weight, shape, step.decode_rows, step.decode_slots, conv_pool, rec_pool,
                kernels, o)
    if step.chunks:
        _prefill(qkv, beta, g, conv_weight, shape, step.chunks, conv_pool, rec_pool, kernels, o)
    return o


def graph_rows_supported(kernels: DeltaRuleKernels, shape: GatedDeltaNetShape) -> bool:
    """Whether `kernels` run a CUDA graph's small step for this layer (LinearGraphRows): the prefill
    convolution over source codes and the in-place recurrent kernel, both taking its shapes."""
    return (_in_place(kernels, shape) and kernels.causal_conv is not None and kernels.conv_windows is not None
            and kernels.conv_supports(shape.conv_dim, shape.conv_kernel, shape.head_k_dim))


def _graph_rows(qkv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, weight: torch.Tensor,
                shape: GatedDeltaNetShape, rows: LinearGraphRows, conv_pool: torch.Tensor,
                rec_pool: torch.Tensor, kernels: DeltaRuleKernels, o: torch.Tensor) -> None:
    """Every sequence of a graph's step token by token over its slot, in place: the convolution over
    source codes (the conv states kept gathered before any slot is written), then one launch of the
    recurrent rule over all sequences, which also writes the snapshots. Shapes fixed by the graph; nothing
    read back to the host."""
    mixed = qkv.new_empty(qkv.shape[0], shape.conv_dim)
    kernels.causal_conv(qkv, rows.conv_codes, conv_pool, weight, mixed, normalize_channels=2 * shape.key_dim,
                        head_dim=shape.head_k_dim)
    windows = conv_pool.new_empty(rows.window_slots.shape[0], shape.conv_dim, weight.shape[-1] - 1)
    kernels.conv_windows(qkv, rows.window_codes, conv_pool, windows)
    conv_pool.index_copy_(0, rows.window_slots, windows)  # the pad entries all write the pad slot
    q, k, v = _split_heads(mixed, shape)
    kernels.recurrent_in_place(q, k, v, g, beta, rec_pool, rows.slots, shape.head_k_dim ** -0.5, o,
                               cu_seqlens=rows.cu_seqlens, normalize=False, fresh=rows.fresh,
                               snapshot_rows=rows.snapshot_rows, snapshot_slots=rows.snapshot_slots)


def _decode(qkv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, weight: torch.Tensor,
            shape: GatedDeltaNetShape, rows: torch.Tensor, slots: torch.Tensor, conv_pool: torch.Tensor,
            rec_pool: torch.Tensor, kernels: DeltaRuleKernels, o: torch.Tensor) -> None:
    """One token per slot: gathers and index_copy_ only (CUDA-graph safe)."""
    token = qkv.index_select(0, rows).to(conv_pool.dtype)[..., None]
    window = torch.cat([conv_pool.index_select(0, slots), token], dim=-1)  # [B, C, K]: carried, then this
    mixed = F.silu((window.float() * weight.float()).sum(-1)).to(qkv.dtype)  # K taps summed in fp32
    conv_pool.index_copy_(0, slots, window[:, :, 1:])
    if _in_place(kernels, shape):
        q, k, v = _split_heads(mixed, shape)  # [B, H, D]
        out = o.new_empty(v.shape)
        kernels.recurrent_in_place(q, k, v, g.index_select(0, rows), beta.index_select(0, rows), rec_pool,
                                   slots, shape.head_k_dim ** -0.5, out)
        o.index_copy_(0, rows, out)
        return
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
    taps = weight.shape[-1]
    conv_kernel = kernels.causal_conv is not None and kernels.conv_supports(shape.conv_dim, taps,
                                                                             shape.head_k_dim)
    plan = _device_plan(chunks, taps, qkv.device, conv_kernel, FLA_CHUNK if kernels.chunk_states else 0)
    rows = plan.rows
    short = _in_place(kernels, shape)
    chunked = not short or any(rnd.longest > SHORT_PIECE for rnd in plan.rounds)
    # fla 0.4's chunked rule takes one key head per value head; the in-place kernel takes either
    groups = shape.num_v_heads // shape.num_k_heads if chunked else 1
    if conv_kernel:
        # One launch: each row's inputs read where they lie (step rows, carried slots), SiLU, q and k
        # normalised, written as the rules read them (q, k, v apart, key heads repeated for fla); then
        # every state the step keeps gathered (before any slot is written), and written.
        q, k = (qkv.new_empty(plan.num_rows, shape.num_k_heads * groups, shape.head_k_dim) for _ in "qk")
        v = qkv.new_empty(plan.num_rows, shape.num_v_heads, shape.head_v_dim)
        kernels.causal_conv(qkv, plan.codes, conv_pool, weight, (q, k, v),
                            normalize_channels=2 * shape.key_dim, head_dim=shape.head_k_dim)
        windows = conv_pool.new_empty(plan.window_dsts.shape[0], shape.conv_dim, taps - 1)
        kernels.conv_windows(qkv, plan.window_codes, conv_pool, windows)
        conv_pool.index_copy_(0, plan.window_dsts, windows)
        columns = None
    else:
        # carried inputs (zeros for fresh chunks) and rows side by side, one conv1d
        carried = conv_pool.index_select(0, plan.slots)  # [M, C, K - 1]
        if plan.fresh is not None:
            carried.index_fill_(0, plan.fresh, 0)
        x = qkv[rows].to(conv_pool.dtype)  # [P, C]
        source = torch.cat([carried.permute(1, 0, 2).reshape(carried.shape[1], -1), x.t()], dim=1)
        columns = source[:, plan.columns]  # [C, L]
        conv = F.conv1d(columns[None].to(weight.dtype), weight[:, None], groups=weight.shape[0])[0]
        mixed = F.silu(conv[:, plan.conv_out].t()).to(qkv.dtype)  # [P, C]
        q, k, v = _split_heads(mixed, shape)
        # q and k normalised here, not by fla's chunked rule: its l2norm kernel takes the row count as a
        # compile-time constant, so every new prompt length would compile it again inside a request's step.
        q, k = _l2norm(q), _l2norm(k)
        if groups > 1:
            q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    beta, g = beta[rows], g[rows]

    # the chunks' rows of o itself where they lie together (no copy at the end)
    packed = o[rows] if isinstance(rows, slice) else o.new_empty(plan.num_rows, shape.num_v_heads,
                                                                 shape.head_v_dim)
    # [M, Hv, Dk, Dv] fp32; None while every chunk starts its sequence (fla starts from zeros itself)
    state = None if plan.all_fresh else rec_pool.index_select(0, plan.slots)
    if state is not None and plan.fresh is not None:
        state.index_fill_(0, plan.fresh, 0)
    for rnd in plan.rounds:
        if rnd.keep is not None:  # some chunks ended last round: the others' states go on
            state = state.index_select(0, rnd.keep)
        at = rnd.at
        if short and rnd.longest <= SHORT_PIECE:  # token by token, the running states updated in place
            if state is None:
                state = rec_pool.new_zeros(plan.slots.shape[0], *rec_pool.shape[1:])
            values = _heads_in_rows(v[at])
            out = packed.new_empty(values.shape)
            gates = (g[at], beta[at]) if g.stride() == beta.stride() else (g[at].contiguous(),
                                                                           beta[at].contiguous())
            kernels.recurrent_in_place(_heads_in_rows(q[at]), _heads_in_rows(k[at]), values,
                                       *gates, state, rnd.order, shape.head_k_dim ** -0.5, out,
                                       cu_seqlens=rnd.cu_seqlens, normalize=False)
            packed[at] = out
        elif rnd.inner_dsts is not None:  # snapshots inside its pieces, from the states at chunk bounds
            out, state, bounds = kernels.chunk_states(
                q[at][None], k[at][None], v[at][None], g=g[at][None], beta=beta[at][None],
                scale=shape.head_k_dim ** -0.5, initial_state=state, cu_seqlens=rnd.cu_seqlens)
            packed[at] = out[0].to(packed.dtype)
            kept = bounds.index_select(0, rnd.inner_sources)
            rec_pool.index_copy_(0, rnd.inner_dsts, kept.to(rec_pool.dtype))
            if columns is not None:
                conv_pool.index_copy_(0, rnd.inner_dsts,
                                      columns[:, rnd.inner_windows].permute(1, 0, 2).to(conv_pool.dtype))
        else:
            out, state = kernels.chunk(
                q[at][None], k[at][None], v[at][None], g=g[at][None], beta=beta[at][None],
                scale=shape.head_k_dim ** -0.5, initial_state=state, output_final_state=True,
                use_qk_l2norm_in_kernel=False, cu_seqlens=rnd.cu_seqlens)
            packed[at] = out[0].to(packed.dtype)
        if rnd.dsts is not None:  # snapshots here, or chunks' last pieces: their slots take the states
            kept = state if rnd.sources is None else state.index_select(0, rnd.sources)
            rec_pool.index_copy_(0, rnd.dsts, kept.to(rec_pool.dtype))
            if columns is not None:  # (the conv kernel's path wrote them all already)
                conv_pool.index_copy_(0, rnd.dsts,
                                      columns[:, rnd.windows].permute(1, 0, 2).to(conv_pool.dtype))
    if not isinstance(rows, slice):
        o[rows] = packed
