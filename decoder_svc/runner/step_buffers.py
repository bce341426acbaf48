"""The runner's step buffers: every step input tensor on the device with a pinned host twin to fill,
both sides views of one byte arena each, so that a step's inputs go up in one copy."""

from __future__ import annotations

import math

import torch


class StepBuffers:
    """The step's input tensors on the device, each with a same-shaped (pinned) host twin to fill, and
    the input embeddings (device only) that CUDA graphs read. KV cache groups after the first have
    their own slot mapping and block tables (`slot_mapping_1`, `block_tables_1`, ...).

    The tensors of each side are views of one byte arena laid out alike, so a step's inputs go up in one
    copy (the arena's prefix up to the last byte the step uses) rather than one per tensor: at batch 1
    the copies were a dozen small transfers, each with its own latency on the stream. The small
    per-sequence tensors come first and the per-token ones in the order small steps use them, so the
    prefix stays short."""

    _ALIGN = 64

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, position_rows: int = 1, num_groups: int = 1, conv_taps: int = 0,
                 graph_tokens: int = 0, deepstack_levels: int = 0) -> None:
        """conv_taps: a hybrid stack's convolution taps when its mixed graphs run linear layers (their
        buffers for graph_tokens rows); 0: none. deepstack_levels: the DeepStack levels of the graphs'
        image rows (a buffer of them for graph_tokens rows; 0: none)."""
        pin = device.type == "cuda"
        positions = (position_rows, max_tokens) if position_rows > 1 else (max_tokens,)
        shapes = {"query_start_loc": ((max_seqs + 1,), torch.int32), "seq_lens": ((max_seqs,), torch.int32),
                  "logits_indices": ((max_seqs,), torch.int64),
                  # pending tokens: their rows in input_ids, and their rows in the last step's samples
                  "pending_rows": ((max_seqs,), torch.int64), "pending_samples": ((max_seqs,), torch.int64),
                  # a hybrid stack's state slot per sequence row of a decode graph (model/linear_state.py)
                  "state_slots": ((max_seqs,), torch.int64),
                  # ... and for its mixed graphs (model/linear_state.py's LinearGraphRows' other fields)
                  **{f"linear_{name}": (shape if conv_taps else (0,) * len(shape), dt)
                     for name, (shape, dt) in graph_rows_buffers(max_seqs, graph_tokens, conv_taps).items()},
                  "input_ids": ((max_tokens,), torch.int64), "slot_mapping": ((max_tokens,), torch.int64),
                  **{f"slot_mapping_{g}": ((max_tokens,), torch.int64) for g in range(1, num_groups)},
                  "positions": (positions, torch.int64),
                  "key_limits": ((max_tokens,), torch.int64),
                  # each token row's LoRA adapter slot (0: the base model, and every graph pad row)
                  "lora_slots": ((max_tokens,), torch.int64),
                  # last: an upload copies the arena's prefix up to the last row it needs, and these are
                  # the large ones (max_seqs x a sequence's most blocks), of which a step needs its own rows
                  **{table_key(g): ((max_seqs, max_blocks), torch.int32) for g in range(num_groups)}}
        self.offsets: dict[str, int] = {}
        size = 0
        for name, (shape, dt) in shapes.items():
            self.offsets[name] = size
            size += -(-math.prod(shape) * dt.itemsize // self._ALIGN) * self._ALIGN
        self._host_arena = torch.zeros(size, dtype=torch.uint8, pin_memory=pin)
        self._dev_arena = torch.zeros(size, dtype=torch.uint8, device=device)

        def views(arena: torch.Tensor) -> dict[str, torch.Tensor]:
            return {k: arena[self.offsets[k]:self.offsets[k] + math.prod(s) * t.itemsize].view(t).view(s)
                    for k, (s, t) in shapes.items()}

        self.host, self.dev = views(self._host_arena), views(self._dev_arena)
        self.np = {k: v.numpy() for k, v in self.host.items()}
        for g in range(num_groups):  # never stored: a padded graph row must not write into any block
            self.host[slot_key(g)].fill_(-1)
            self.dev[slot_key(g)].fill_(-1)
        self.embeds = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)  # hidden 0: no graphs
        # the DeepStack levels a graph adds after its first layers: a step's image rows, zeros elsewhere
        self.deepstack = (torch.zeros(deepstack_levels, graph_tokens, hidden_size, dtype=dtype, device=device)
                          if deepstack_levels and graph_tokens and hidden_size else None)

    def set(self, name: str, values: torch.Tensor) -> None:
        """Fill a buffer on both sides (start-up: what graphs are captured over)."""
        self.host[name].copy_(values)
        self.dev[name].copy_(values)

    def upload(self, counts: dict[str, int]) -> None:
        """Copy the first counts[name] rows of each host buffer to the device, asynchronously, in one copy
        of the arena's prefix (it may carry stale rows of other buffers: no step reads rows it did not
        fill)."""
        end = 0
        for name, n in counts.items():
            if n:
                buf = self.host[name]
                if name == "positions" and buf.dim() == 2:  # [rows, tokens]: the last row's first n
                    used = (buf.shape[0] - 1) * buf.stride(0) + n
                else:
                    used = n * buf.stride(0)
                end = max(end, self.offsets[name] + used * buf.element_size())
        if end:
            self._dev_arena[:end].copy_(self._host_arena[:end], non_blocking=True)


# LinearGraphRows' fields beyond cu_seqlens and slots (StepBuffers' `linear_*`): (rows per sequence, or
# None: one per token row; columns: 0 a vector, else "window" (taps - 1) or "taps"; dtype).
_GRAPH_ROWS_FIELDS = {"fresh": (1, 0, torch.int32), "snapshot_rows": (1, 0, torch.int32),
                      "snapshot_slots": (1, 0, torch.int64), "window_slots": (2, 0, torch.int64),
                      "window_codes": (2, "window", torch.int32), "conv_codes": (None, "taps", torch.int32)}


def graph_rows_buffers(max_seqs: int, graph_tokens: int, taps: int) -> dict[str, tuple[tuple, torch.dtype]]:
    """Shapes and dtypes of the `linear_*` buffers (_GRAPH_ROWS_FIELDS)."""
    columns = {"window": max(taps - 1, 0), "taps": taps}
    rows = graph_rows_used(max_seqs, graph_tokens)
    return {name: ((rows[name], columns[cols]) if cols else (rows[name],), dt)
            for name, (_, cols, dt) in _GRAPH_ROWS_FIELDS.items()}


def graph_rows_used(num_seqs: int, num_tokens: int) -> dict[str, int]:
    """Rows of each `linear_*` buffer that a graph of num_seqs sequences over num_tokens rows reads."""
    return {name: num_tokens if per_seq is None else per_seq * num_seqs
            for name, (per_seq, _, _) in _GRAPH_ROWS_FIELDS.items()}


def slot_key(group: int) -> str:
    """The buffer name of a KV cache group's slot mapping."""
    return f"slot_mapping_{group}" if group else "slot_mapping"


def table_key(group: int) -> str:
    """The buffer name of a KV cache group's block tables."""
    return f"block_tables_{group}" if group else "block_tables"
