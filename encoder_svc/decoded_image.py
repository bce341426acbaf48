"""An image decoded and content-hashed: the one function the decode pool's processes and the server's
threads both run, so the hash is the same either way (common/hashing.py frames it; tests check pool
against threads against `hash_image`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
from PIL import Image

from common.hashing import hash_image_file
from common.images import ImageLimits, decode_image_array


class SlotLease(Protocol):
    """A hold on the shared-memory slot that a DecodedImage's pixels live in (decode_pool.py)."""

    def release(self) -> None:
        """Give the slot back (once; any thread)."""


@dataclass(frozen=True)
class DecodedImage:
    """A decoded RGB image and its content hash: what the cache is keyed by and the vision worker reads.

    From `DecodePool.decode(..., in_slot=True)` the pixels are a view of the pool's shared-memory slot,
    valid until `release()` (which gives the slot back; also done when the image is collected).
    """

    content_hash: str  # hex, as on the wire
    width: int
    height: int
    pixels: bytes | memoryview  # RGB rows, as `Image.tobytes()` gives them (a flat byte view)
    slot: SlotLease | None = field(default=None, compare=False, repr=False)

    mode = "RGB"

    def release(self) -> None:
        """Give the pixels' slot back to the pool (no-op for owned pixels; idempotent, any thread)."""
        if self.slot is not None:
            self.slot.release()

    def owned(self) -> DecodedImage:
        """The same image with its pixels as bytes of its own (pickled to cross processes: a view cannot)."""
        return replace(self, pixels=bytes(self.pixels), slot=None)

    def to_pil(self) -> Image.Image:
        """A PIL image over `pixels` (no copy; read-only)."""
        return Image.frombuffer("RGB", (self.width, self.height), self.pixels, "raw", "RGB", 0, 1)

    def array(self) -> np.ndarray:
        """A read-only uint8 [H, W, 3] view of `pixels` (no copy)."""
        return np.frombuffer(self.pixels, dtype=np.uint8).reshape(self.height, self.width, 3)


def decode_and_hash(data: bytes, limits: ImageLimits, fingerprint: str, salt: str) -> DecodedImage:
    """Decode an image file (limits checked; ImageError for a bad one) into RGB pixels, named by the
    file's content hash (`hash_image_file`: the decoder names it the same way without decoding it)."""
    pixels = decode_image_array(data, limits)
    height, width, _ = pixels.shape
    return DecodedImage(hash_image_file(data, fingerprint, salt), width, height,
                        memoryview(pixels).cast("B").toreadonly())
