"""Where the engine gets image embeddings from: a small interface with a local and a remote side.

Contract (every implementation):

- Keys are (request_id, content_hash). `request` is idempotent per key: asking twice is one ask.
- `request` never blocks on encoding. A local source may compute synchronously inside it; a remote one
  (`decoder_svc/encoders/remote_source.py`: a gRPC encoder client on background threads) sends the ask and
  returns at once. `prefetch=True` marks lookahead work the encoder may run at lower priority.
- `poll` is non-blocking and says PENDING, READY or FAILED. The scheduler never schedules an image
  token until its key is READY, and fails the request (with `error()`'s text) on FAILED, so a dead
  encoder cannot hang the engine.
- `get` is called only when READY and returns [num_image_tokens, hidden] rows (or [parts, tokens,
  hidden] for a multi-part embedding: Qwen3-VL's DeepStack), ideally zero-copy
  (a view into shared memory or a CUDA IPC arena, synchronised with the producer). The engine copies
  the rows it needs into its own input buffer during the step, and may call `get` again on a later
  step for the same key (an image can straddle prefill chunks).
- `release` ends the engine's use of a key (or of every key of a request when content_hash is None):
  the source drops its lease. Idempotent; unknown keys are ignored. After release the engine never
  reads the rows again.
- `stats` is a copy of the source's counters (a remote source's asks, leases, transports), or None.
- `lookahead` receives the next queued requests' images whose KV is not cached yet; the default asks
  for each with prefetch=True.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from common.image_geometry import ImageSettings
from decoder_svc.engine.following_bytes import FollowingBytes


class EmbeddingState(enum.Enum):
    """Where one (request, image) embedding stands. A source's `poll` answers with the first four; the
    engine's image bookkeeping (engine/image_inputs.py) also marks an image DONE or SKIPPED."""

    UNKNOWN = "unknown"  # not asked for (never, or released since)
    PENDING = "pending"  # asked for; being encoded or fetched
    READY = "ready"  # rows can be read
    FAILED = "failed"
    DONE = "done"  # every token of the image is in KV; its lease released
    SKIPPED = "skipped"  # the image's whole span was in cached KV: never needed


@dataclass(frozen=True)
class VideoSource:
    """A video as the encoder is sent it: the container file (None: known to it by content hash; in an
    engine core, a FollowingBytes until the file arrives behind its request) and the request's sampling
    and resize settings (0: the model's default)."""

    data: bytes | FollowingBytes | None
    fps: float = 0.0
    max_frames: int = 0
    min_pixels: int = 0
    max_pixels: int = 0


@dataclass(frozen=True)
class EmbeddingRequest:
    """One image (or video) a request needs."""

    request_id: str
    content_hash: str
    image: bytes | Image.Image | None  # encoded file, decoded image, or None: the source knows the hash
    cache_salt: str = ""
    prefetch: bool = False
    pixels: ImageSettings | None = None  # a Qwen-VL pixel range, a Gemma 3 crop choice (None: none)
    video: VideoSource | None = None  # set for a video (then `image` is None)
    sent_ahead: bool = False  # the file is on its way to its encoder already (front end's send-ahead)


class EmbeddingSource(ABC):
    """Produces image embeddings for the engine; see the module docstring for the contract."""

    # Called (on any thread) when a key turns READY or FAILED, so an engine loop asleep while its requests
    # wait on embeddings wakes at once instead of at its next poll. None: nobody listens.
    on_change: Callable[[], None] | None = None

    def notify_change(self) -> None:
        """Tell the listener, if any, that some key's state changed."""
        listener = self.on_change
        if listener is not None:
            listener()

    @abstractmethod
    def request(self, req: EmbeddingRequest) -> None:
        """Start producing (or leasing) the embedding of req.content_hash for req.request_id."""

    @abstractmethod
    def poll(self, request_id: str, content_hash: str) -> EmbeddingState:
        """Non-blocking state of the key."""

    @abstractmethod
    def get(self, request_id: str, content_hash: str) -> torch.Tensor:
        """The embedding rows [num_tokens, hidden] of a READY key."""

    @abstractmethod
    def release(self, request_id: str, content_hash: str | None = None) -> None:
        """Release one key, or every key of the request when content_hash is None."""

    def error(self, request_id: str, content_hash: str) -> str:
        """Why a FAILED key failed (a message for the client)."""
        return f"embedding of image {content_hash[:16]} failed"

    def pop_error_code(self, request_id: str) -> str | None:
        """The gRPC status name (e.g. "UNAVAILABLE") that the request's failed image calls for, once;
        None: an internal error."""
        return None

    def cache_hit(self, request_id: str, content_hash: str) -> bool:
        """Whether a READY key was served from the encoder's cache without running the vision tower."""
        return False

    def is_ready(self, request_id: str, content_hash: str) -> bool:
        """poll() == READY."""
        return self.poll(request_id, content_hash) == EmbeddingState.READY

    def lookahead(self, requests: list[EmbeddingRequest]) -> None:
        """Prefetch hook, called each step with queued requests' uncached images (prefetch=True)."""
        for req in requests:
            self.request(req)

    def stats(self) -> Any:
        """A copy of the source's own counters, a stats record (common/stats.py); None: it keeps none."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work and release everything."""
