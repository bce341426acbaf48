"""Embeddings this decoder keeps after its requests are done with them, for the next request with the
same image.

A follow-up question about an image resumes from the prefix cache up to the last KV block boundary at or
before the image's end (a hybrid model's state snapshot sits there too), so the image's last few tokens
are computed again and need its embedding. Without a copy here that is one Encode round trip to the
encoder (its cache hit: no tower, but a gRPC call, a lease and a copy) on the follow-up's critical path.
The remote source already holds each embedding as a tensor of its own (copied out of the encoder's
arena); on release it hands the tensor here instead of dropping it, and a later ask with the same key is
READY at once.

The key is everything the rows depend on: the image's content hash, the tenant's cache salt (a tenant never
finds another's entries, nor learns from timing that they exist) and the resize settings. Entries are
kept least recently used first out within a byte budget (0: none kept); a tensor larger than the budget is
not kept. Nothing here is a lease: the encoder's memory is not held, and the budget bounds ours.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch

from decoder_svc.engine.embedding_source import EmbeddingRequest


def retain_key(req: EmbeddingRequest) -> tuple:
    """What an embedding's rows depend on: the content hash, the tenant's salt, the resize settings (a
    video's sampling too; not its bytes, which the hash names)."""
    video = req.video
    settings = None if video is None else (video.fps, video.max_frames, video.min_pixels, video.max_pixels)
    return (req.content_hash, req.cache_salt, req.pixels, settings)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class RetainedEmbeddings:
    """An LRU of embedding tensors by key within `budget_bytes`. Not thread-safe: the caller locks."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.bytes_held = 0
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, key: Hashable) -> torch.Tensor | None:
        """The tensor kept under key (now the most recently used), or None. It stays kept: callers
        only read it."""
        tensor = self._entries.get(key)
        if tensor is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return tensor

    def keep(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Keep tensor under key, dropping the least recently used entries it needs room from."""
        size = tensor_bytes(tensor)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if size > self.budget_bytes:
            return
        while self.bytes_held + size > self.budget_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes_held -= tensor_bytes(dropped)
            self.evictions += 1
        self._entries[key] = tensor
        self.bytes_held += size

    def clear(self) -> None:
        """Drop every entry (the source's close)."""
        self._entries.clear()
        self.bytes_held = 0
