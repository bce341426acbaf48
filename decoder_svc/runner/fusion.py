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


def image_key_limits(slots: np.ndarray, start: int, n: int) -> np.ndarray:
    """The last key position each of a chunk's n rows may see (AttentionMetadata.key_limits): its own,
    or for an image row the last row of its image, a run of consecutive slots. The scheduler keeps each
    image whole inside a fresh chunk, so a run never continues past the chunk."""
    limits = np.arange(start, start + n, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    if slots.size:
        run_ends = np.append(np.nonzero(np.diff(slots) != 1)[0], slots.size - 1)  # last slot of each run
        owner = np.searchsorted(run_ends, np.arange(slots.size))  # each slot's run
        limits[slots] = start + slots[run_ends[owner]]
    return limits


def fuse_image_rows(embeds: torch.Tensor, slots: torch.Tensor,
                    rows: list[torch.Tensor]) -> torch.Tensor | None:
    """Write rows (in order) into embeds at the flat row indexes `slots`; a count mismatch raises.

    Multi-part rows ([parts, n, hidden], Qwen3-VL) fuse their part 0; the other parts come back as one
    [parts - 1, slots, hidden] tensor (the DeepStack levels the model adds after its first layers), in
    the slots' order. None for plain rows."""
    n_rows = sum(r.shape[-2] for r in rows)
    if slots.numel() != n_rows:
        raise FusionError(f"{slots.numel()} image-token positions but {n_rows} embedding rows")
    if not n_rows:
        return None
    if len({r.dim() for r in rows}) != 1 or len({r.shape[:-2] for r in rows}) != 1:
        raise FusionError(f"images of one step have different part counts: {[tuple(r.shape) for r in rows]}")
    joined = torch.cat([r.to(device=embeds.device, dtype=embeds.dtype) for r in rows], dim=-2)
    if joined.dim() == 2:
        embeds[slots] = joined
        return None
    embeds[slots] = joined[0]
    return joined[1:]
