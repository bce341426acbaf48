"""One image of one request, as the remote embedding source tracks it from its ask to its release."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from decoder_svc.engine.embedding_source import EmbeddingState


@dataclass
class FetchSlot:
    """What the source knows of one (request, image) key: its state, its rows once READY, its Encode
    in flight."""

    status: EmbeddingState = EmbeddingState.PENDING
    prefetch: bool = False
    tensor: torch.Tensor | None = None
    encoder: str = ""
    cache_hit: bool = False
    transport: str = ""
    error: str = ""
    code: grpc.StatusCode | None = None
    released: bool = False
    polled: bool = False
    deadline: float = 0.0  # monotonic time by which the image is ready or failed
    boosted: bool = False  # asked for by lookahead, then needed now: told the encoder so
    started: bool = False  # a worker took its fetch up (one only: a queued duplicate sends nothing)
    call: grpc.Future | None = None  # its Encode in flight: cancelled when the slot is released
    ask: str = ""  # the request_id of its Encodes, its own: a Release by it frees an unread answer's lease
