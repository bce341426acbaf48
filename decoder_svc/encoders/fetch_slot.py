"""One image of one request, as the remote embedding source tracks it from its ask to its release."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    name: str = ""  # unique to the slot; each Encode's request_id (its ask) is the name and an attempt number
    ask: str = ""  # its latest Encode's request_id, its own: a Release by it frees an unread answer's lease
    attempts: int = 0
    # (encoder, ask) of Encodes that failed on the link: their answers may have been granted leases and lost
    # on the way (a reset connection). Released by name once the encoder answers again, or the slot ends.
    abandoned: list[tuple[str, str]] = field(default_factory=list)
    retain_key: tuple | None = None  # what its rows are kept under after release (retained.py's retain_key)

    def next_ask(self) -> str:
        """A fresh request_id for the next Encode: a late Release of a failed attempt's name can never
        free the lease of the attempt after it."""
        self.attempts += 1
        self.ask = f"{self.name}.{self.attempts}"
        return self.ask
