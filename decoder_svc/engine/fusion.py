"""Which embedding rows a chunk needs (the runner writes them at the image-token positions).

An image may straddle chunks: a chunk covering tokens [start, end) takes rows
[max(start - offset, 0), min(end, offset + length) - offset) of that image.
"""

from __future__ import annotations

import torch

from decoder_svc.engine.request import Request
from decoder_svc.runner.fusion import FusionError


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
