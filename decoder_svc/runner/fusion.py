"""Writing image embeddings into a step's input embeddings.

The slots are found on the host, from token ids the runner already has: a row is an image slot when its
token id is an image token and its position is inside the prompt (HF embeds a generated image-token id as
ordinary text). No device synchronisation, unlike a mask.sum() on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch


class FusionError(RuntimeError):
    """Image rows and placeholder tokens disagree: writing them would misalign the prompt."""


def image_slots(token_ids: np.ndarray, start: int, num_prompt_tokens: int,
                mm_token_ids: np.ndarray) -> np.ndarray:
    """Indexes into token_ids (a chunk starting at position `start`) of the image-token rows."""
    in_prompt = np.arange(start, start + len(token_ids)) < num_prompt_tokens
    return np.nonzero(np.isin(token_ids, mm_token_ids) & in_prompt)[0]


def fuse_image_rows(embeds: torch.Tensor, slots: torch.Tensor, rows: list[torch.Tensor]) -> None:
    """Write rows (in order) into embeds at the flat row indexes `slots`; a count mismatch raises."""
    n_rows = sum(r.shape[0] for r in rows)
    if slots.numel() != n_rows:
        raise FusionError(f"{slots.numel()} image-token positions but {n_rows} embedding rows")
    if n_rows:
        embeds[slots] = torch.cat([r.to(device=embeds.device, dtype=embeds.dtype) for r in rows])
