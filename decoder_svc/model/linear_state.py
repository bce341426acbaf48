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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.gated_deltanet_shape import GatedDeltaNetShape


@dataclass(frozen=True)
class LinearStatePool:
    """Every linear layer's state slots: conv[layer] [slots, conv_dim, K - 1] (model dtype) and
    recurrent[layer] [slots, Hv, Dk, Dv] (fp32), keyed by the layer's index in the stack."""

    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]
    num_slots: int

    @classmethod
    def allocate(cls, cfg: TextModelConfig, num_slots: int, dtype: torch.dtype,
                 device: torch.device | str) -> LinearStatePool:
        """Zeroed slots for every linear layer of cfg (none for a stack without any)."""
        if not cfg.linear_layers:
            return cls({}, {}, 0)
        shape = GatedDeltaNetShape.from_model_config(cfg)
        conv = {i: torch.zeros(shape.conv_state_shape(num_slots), dtype=dtype, device=device)
                for i in cfg.linear_layers}
        recurrent = {i: torch.zeros(shape.recurrent_state_shape(num_slots), dtype=torch.float32,
                                    device=device) for i in cfg.linear_layers}
        return cls(conv, recurrent, num_slots)

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy slot src into slot dst in every layer, for each (src, dst); no dst is another's src."""
        if not copies:
            return
        device = next(iter(self.conv.values())).device
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
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


def continues_slot(num_tokens: int, start: int, snapshots: tuple | list) -> bool:
    """Whether a sequence's part of a step is one token continuing its slot's state and taking no
    snapshot: what the recurrent (decode) form runs, and what a hybrid stack's decode graphs compute.
    A first token starts from a zero state instead: the chunked form."""
    return num_tokens == 1 and start > 0 and not snapshots


@dataclass(frozen=True)
class LinearStateStep:
    """What the linear layers of one step read and write: the pool, the chunked-form chunks, and the
    single-token continuations' rows and slots (device tensors; None when there is none)."""

    pool: LinearStatePool
    chunks: tuple[LinearChunk, ...] = ()
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None

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
