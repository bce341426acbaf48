"""The state cache of a hybrid stack's linear-attention (Gated DeltaNet) layers, beside the paged KV cache.

A linear layer keeps no per-token keys and values: a sequence's past is one fixed-size state per layer
(model/gated_deltanet.py), its conv state [conv_dim, K - 1] in the model's dtype and its recurrent state
[Hv, Dk, Dv] in fp32. The pool holds `num_slots` of them per linear layer; a running request owns one slot
from its admission to its end (engine/state_slots.py hands them out), whatever its length. Slot contents
are only read after the request's own earlier chunks wrote them: a chunk at position 0 starts from zeros
(never from what a previous owner left), and a preempted request recomputes from position 0.

`LinearStateStep` is one step's view of it: which rows of the flat token batch continue which slot. Rows
of single-token continuations (decodes) run together in the recurrent form; every other chunk (a prefill,
or a later chunk of one, which carries the state across the cut) runs alone in the chunked form. Slots
past the requests' hold snapshots of the state after prompt prefixes (engine/state_snapshots.py): a
chunk may name positions inside it whose state is copied into a snapshot slot (the chunk is then run in
pieces cut there), and a step's `copy_slots` restores a snapshot into a request's slot before it runs.

A CUDA graph of a small step sees it as `LinearGraphRows` instead: buffers of the graph's fixed shapes,
filled per step by `stage_graph_rows`, in which every sequence (a decode row, a warm request's few new
tokens, a short prompt) runs token by token from its slot's state, or a zero one where it starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.gated_deltanet_shape import GatedDeltaNetShape


@dataclass(frozen=True)
class LinearStatePool:
    """Every linear layer's state slots: conv[layer] [slots, conv_dim, K - 1] (model dtype) and
    recurrent[layer] [slots, Hv, Dk, Dv] (fp32), keyed by the layer's index in the stack. Allocated, each
    kind is one tensor over the layers (`stacks`: conv, recurrent; the dicts hold views of it), so that a
    copy between slots is a few launches, not a few per layer."""

    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]
    num_slots: int
    stacks: tuple[torch.Tensor, ...] = ()  # [layers, slots, ...] per kind, or none (per-layer tensors)

    @classmethod
    def allocate(cls, cfg: TextModelConfig, num_slots: int, dtype: torch.dtype,
                 device: torch.device | str) -> LinearStatePool:
        """Zeroed slots for every linear layer of cfg (none for a stack without any)."""
        if not cfg.linear_layers:
            return cls({}, {}, 0)
        shape, layers = GatedDeltaNetShape.from_model_config(cfg), len(cfg.linear_layers)
        conv = torch.zeros((layers, *shape.conv_state_shape(num_slots)), dtype=dtype, device=device)
        recurrent = torch.zeros((layers, *shape.recurrent_state_shape(num_slots)), dtype=torch.float32,
                                device=device)
        return cls({layer: conv[j] for j, layer in enumerate(cfg.linear_layers)},
                   {layer: recurrent[j] for j, layer in enumerate(cfg.linear_layers)}, num_slots,
                   (conv, recurrent))

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy slot src into slot dst in every layer, for each (src, dst); no dst is another's src."""
        if not copies:
            return
        device = next(iter(self.conv.values())).device
        # pinned and asynchronous: a blocking copy would wait for the step in flight (async scheduling)
        indices = torch.tensor([[s for s, _ in copies], [d for _, d in copies]], dtype=torch.long,
                               pin_memory=device.type == "cuda")
        src, dst = indices.to(device, non_blocking=True)
        if self.stacks:  # every layer at once: the slots are dimension 1
            for stack in self.stacks:
                stack.index_copy_(1, dst, stack.index_select(1, src))
            return
        for tensors in (self.conv, self.recurrent):
            for t in tensors.values():
                t.index_copy_(0, dst, t.index_select(0, src))

    @staticmethod
    def bytes_per_slot(cfg: TextModelConfig, dtype: torch.dtype) -> int:
        """Bytes one request's slot takes over every linear layer (0 for a stack without any)."""
        if not cfg.linear_layers:
            return 0
        return len(cfg.linear_layers) * GatedDeltaNetShape.from_model_config(cfg).state_nbytes(dtype)


@dataclass(frozen=True)
class LinearChunk:
    """Rows [first_row, end_row) of the flat batch: a chunk of the sequence in `slot`; `fresh` when it
    starts the sequence (position 0: a zero state, whatever the slot holds); `snapshots` (tokens into the
    chunk, snapshot slot): where the state after that many of its tokens is copied, in order."""

    first_row: int
    end_row: int
    slot: int
    fresh: bool
    snapshots: tuple[tuple[int, int], ...] = ()


# A sequence of at most this many tokens in a step runs its delta rule token by token (one launch, its
# bounds on the device) rather than through the chunked form: one chunk of fla's chunked rule.
SHORT_PIECE = 64


def conv_source_codes(first_row: int, tokens: int, slot: int, fresh: bool, ends: list[int], taps: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """common/kernels/causal_conv.py's source codes for one sequence's rows [first_row, first_row + tokens)
    of a step, over the step's rows and the layer's conv-state pool: (codes int64 [tokens, K], each row's K
    inputs, oldest first; windows int64 [len(ends), K - 1], the K - 1 inputs before each of `ends` (tokens
    into the sequence) whose conv state is kept). An input before the sequence's first row is its slot's
    carried column (code -(slot * (K - 1) + column) - 2), or zeros (-1) for a fresh sequence."""
    carry = taps - 1
    rows = np.arange(tokens)[:, None] - carry + np.arange(taps)[None, :]
    before = np.asarray(ends, dtype=np.int64)[:, None] - carry + np.arange(carry)[None, :]

    def codes(inputs: np.ndarray) -> np.ndarray:
        carried = -1 if fresh else -(slot * carry + carry + inputs) - 2
        return np.where(inputs >= 0, first_row + inputs, carried)

    return codes(rows), codes(before)


@dataclass(frozen=True)
class LinearGraphRows:
    """A small step as a CUDA graph of T rows and S sequences runs it (device buffers of those fixed
    shapes): sequence s is rows [cu_seqlens[s], cu_seqlens[s + 1]) of slot slots[s], from a zero state
    where fresh[s] is nonzero; the state after row snapshot_rows[s] (-1: none) is copied into slot
    snapshot_slots[s] too. The convolution reads conv_codes; slot window_slots[j] keeps the inputs
    window_codes[j] names (the S sequences' own slots, then their snapshot slots; codes as
    `conv_source_codes` makes them). The graph's pad sequences, and sequences taking no snapshot, name one
    slot that no request holds."""

    cu_seqlens: torch.Tensor  # [S + 1] int32
    slots: torch.Tensor  # [S] int64
    fresh: torch.Tensor  # [S] int32
    snapshot_rows: torch.Tensor  # [S] int32
    snapshot_slots: torch.Tensor  # [S] int64
    conv_codes: torch.Tensor  # [T, K] int32
    window_codes: torch.Tensor  # [2S, K - 1] int32
    window_slots: torch.Tensor  # [2S] int64


def graph_takes(num_tokens: int, snapshots: tuple | list) -> bool:
    """Whether a graph's step (LinearGraphRows) can run a sequence's part: short, and at most one
    snapshot."""
    return num_tokens <= SHORT_PIECE and len(snapshots) <= 1


def stage_graph_rows(sequences: list[tuple], num_seqs: int, pad_slot: int, out: dict[str, np.ndarray]
                     ) -> None:
    """Fill a graph's LinearGraphRows host buffers (out: numpy arrays by field name, each at least as long
    as the graph needs; conv_codes exactly its T rows) for `sequences`, (first row, tokens, start position,
    slot, snapshots) in row order, each one `graph_takes`; the rest of the graph's sequences and rows are
    pads: fresh, on pad_slot, with zero inputs."""
    taps = out["conv_codes"].shape[1]
    out["slots"][:num_seqs], out["fresh"][:num_seqs] = pad_slot, 1
    out["snapshot_rows"][:num_seqs], out["snapshot_slots"][:num_seqs] = -1, pad_slot
    out["conv_codes"][:] = -1
    out["window_codes"][:2 * num_seqs], out["window_slots"][:2 * num_seqs] = -1, pad_slot
    for i, (first_row, n, start, slot, snapshots) in enumerate(sequences):
        if not graph_takes(n, snapshots):
            raise ValueError(f"a graph's step takes sequences of at most {SHORT_PIECE} tokens and one "
                             "snapshot")
        ends = [n, *(k for k, _ in snapshots)]
        codes, windows = conv_source_codes(first_row, n, slot, start == 0, ends, taps)
        out["slots"][i], out["fresh"][i] = slot, start == 0
        out["conv_codes"][first_row:first_row + n] = codes
        out["window_codes"][i], out["window_slots"][i] = windows[0], slot
        for k, snapshot_slot in snapshots:
            out["snapshot_rows"][i], out["snapshot_slots"][i] = first_row + k - 1, snapshot_slot
            out["window_codes"][num_seqs + i], out["window_slots"][num_seqs + i] = windows[1], snapshot_slot


def continues_slot(num_tokens: int, start: int, snapshots: tuple | list) -> bool:
    """Whether a sequence's part of a step is one token continuing its slot's state and taking no
    snapshot: what the recurrent (decode) form runs, and what a hybrid stack's decode graphs compute.
    A first token starts from a zero state instead: the chunked form."""
    return num_tokens == 1 and start > 0 and not snapshots


# A layer's token mixing over a step (gated_deltanet_fla.forward_packed with the layer's projected rows
# bound): step -> o [rows, Hv, Dv].
Mix = Callable[["LinearStateStep"], torch.Tensor]


@dataclass(frozen=True)
class LinearStateStep:
    """What the linear layers of one step read and write: the pool, the chunked-form chunks, and the
    single-token continuations' rows and slots (device tensors; None when there is none); or, for a CUDA
    graph of a small step, `graph` alone.

    `piecewise` (a piecewise graph's capture or emulation, runner/piecewise_graphs.py): each layer hands
    its token mixing to it, with the step's row count, instead of running it; it returns the tensor the
    rest of the layer reads as the mixing's output."""

    pool: LinearStatePool
    chunks: tuple[LinearChunk, ...] = ()
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    graph: LinearGraphRows | None = None
    piecewise: Callable[[Mix, int], torch.Tensor] | None = None

    @classmethod
    def build(cls, pool: LinearStatePool, sequences: list[tuple[int, int, int, int, tuple]],
              device: torch.device | str) -> LinearStateStep:
        """From (first row, tokens, start position, slot, snapshots) per sequence of the step, in row
        order (snapshots: LinearChunk's)."""
        chunks, rows, slots = [], [], []
        for first_row, n, start, slot, snapshots in sequences:
            if slot < 0 or slot >= pool.num_slots:
                raise ValueError(f"state slot {slot} is not one of the pool's {pool.num_slots}")
            if any(not 0 < k <= n or not 0 <= s < pool.num_slots for k, s in snapshots):
                raise ValueError(f"snapshots {snapshots} do not fit a chunk of {n} tokens and the pool")
            if continues_slot(n, start, snapshots):
                rows.append(first_row)
                slots.append(slot)
            elif n > 0:
                chunks.append(LinearChunk(first_row, first_row + n, slot, start == 0,
                                          tuple(sorted(snapshots))))
        as_tensor = (lambda v: torch.tensor(v, dtype=torch.long, device=device)) if rows else (lambda v: None)
        return cls(pool, tuple(chunks), as_tensor(rows), as_tensor(slots))
