"""A step's image rows cross the tensor-parallel ranks as one tensor, not inside the pickled step.

Rank 0 holds each image's rows where the embedding source put them (on its GPU, or in host memory). The
step's plain data (tokens, block tables, sampling) is pickled and broadcast on the gloo control group, but
the rows, megabytes per large image (1225 rows x 3584 x 2 bytes = 8.8 MB for a 1024x1024 Qwen2.5-VL-7B
image), go as one packed byte tensor on the default group: NCCL from GPU to GPU on a GPU host (no copy to
the host, no pickling, no sync of rank 0's stream), gloo on CPU. Each worker unpacks views of its copy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from decoder_svc.runner.inputs import ModelInput

_ALIGN = 16  # every piece starts at a multiple of 16 bytes, so each view is aligned for its dtype


@dataclass(frozen=True)
class RowPiece:
    """Where one image-row tensor of the step lies in the packed buffer."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class RowsLayout:
    """Every sequence's row pieces, in the step's order, and the packed buffer's size."""

    pieces: list[list[RowPiece]]
    nbytes: int


def split_rows(batch: ModelInput) -> tuple[ModelInput, RowsLayout | None, torch.Tensor | None]:
    """(the step without its image rows, their layout, the packed bytes); (batch, None, None) when the
    step has no image rows."""
    if not any(s.image_rows for s in batch.sequences):
        return batch, None, None
    pieces: list[list[RowPiece]] = []
    flats: list[torch.Tensor] = []
    offset = 0
    for seq in batch.sequences:
        mine = []
        for rows in seq.image_rows:
            flat = rows.contiguous().view(-1).view(torch.uint8)
            pad = -flat.numel() % _ALIGN
            mine.append(RowPiece(offset, tuple(rows.shape), rows.dtype))
            flats.append(flat)
            if pad:
                flats.append(flat.new_zeros(pad))
            offset += flat.numel() + pad
        pieces.append(mine)
    stripped = [dataclasses.replace(s, image_rows=[]) for s in batch.sequences]
    return dataclasses.replace(batch, sequences=stripped), RowsLayout(pieces, offset), torch.cat(flats)


def join_rows(batch: ModelInput, layout: RowsLayout, packed: torch.Tensor) -> ModelInput:
    """The step with its image rows back, as views of `packed` (split_rows's inverse)."""
    sequences = []
    for seq, pieces in zip(batch.sequences, layout.pieces, strict=True):
        rows = [packed[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape) for p in pieces]
        sequences.append(dataclasses.replace(seq, image_rows=rows))
    return dataclasses.replace(batch, sequences=sequences)


def broadcast_rows(packed: torch.Tensor) -> None:
    """Rank 0's side: send the packed rows to every rank (on the default group)."""
    dist.broadcast(packed, src=0)


def receive_rows(batch: ModelInput, layout: RowsLayout, device: str) -> ModelInput:
    """A worker's side: receive the packed rows onto `device` and put them back into the step."""
    packed = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    dist.broadcast(packed, src=0)
    return join_rows(batch, layout, packed)
