"""Writing image embeddings into a chunk's input embeddings.

The rows whose token id is in mm_token_ids receive, in order, the embedding rows of the image tokens
inside the chunk. An image may straddle chunks: a chunk covering tokens [start, end) takes rows
[max(start - offset, 0), min(end, offset + length) - offset) of that image. A count mismatch raises.
"""

from __future__ import annotations

import torch

from decoder_svc.engine.request import Request


class FusionError(RuntimeError):
    """Image rows and placeholder tokens disagree: writing them would misalign the prompt."""


def image_rows_for_chunk(request: Request, start: int, end: int) -> list[torch.Tensor]:
    """The embedding rows of every image token in [start, end), in token order."""
    rows = []
    for img in sorted(request.images, key=lambda i: i.offset):
        lo, hi = max(start, img.offset), min(end, img.end)
        if lo >= hi:
            continue
        if img.embedding is None:
            raise FusionError(f"request {request.request_id}: image at {img.offset} scheduled without its "
                              "embedding")
        rows.append(img.embedding[lo - img.offset:hi - img.offset])
    return rows


def fuse_image_rows(embeds: torch.Tensor, input_ids: torch.Tensor, mm_token_ids: torch.Tensor,
                    rows: list[torch.Tensor], is_prompt: torch.Tensor) -> torch.Tensor:
    """Write rows into embeds at the prompt positions whose id is an image token; returns embeds.

    Generated tokens are never image slots, even when the model happens to emit the image token id
    (HF embeds such a token as ordinary text too).
    """
    mask = torch.isin(input_ids, mm_token_ids) & is_prompt
    n_slots = int(mask.sum())
    n_rows = sum(r.shape[0] for r in rows)
    if n_slots != n_rows:
        raise FusionError(f"{n_slots} image-token positions but {n_rows} embedding rows")
    if n_rows:
        embeds[mask] = torch.cat(rows).to(device=embeds.device, dtype=embeds.dtype)
    return embeds
