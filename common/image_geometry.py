"""Image geometry types every family and service shares: a patch grid, a pixel range, the error a size
the model cannot take raises, and the fingerprint an image's content hash is made under.

They are family-neutral on purpose: the engine, the services and the transports carry grids and pixel
ranges without knowing whose layout made them (a family's own rules live in its folder,
common/families/<name>/layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import InvalidInputError


class ImageGeometryError(InvalidInputError):
    """An image whose size (or requested pixel range) the model cannot take."""


Grid = tuple[int, int, int]  # (t, h, w) in patches, before merging


@dataclass(frozen=True)
class PixelRange:
    """The pixel-count range one image is resized into (min_pixels, max_pixels)."""

    min_pixels: int
    max_pixels: int

    def key(self) -> str:
        """Part of the content hash: the same bytes at two ranges are two cache entries."""
        return f"pixels={self.min_pixels}-{self.max_pixels}"


def hash_fingerprint(fingerprint: str, pixels: PixelRange | None) -> str:
    """The model fingerprint an image's content hash is made under: with its pixel range where the family
    resizes into one (the same bytes resized two ways are two embeddings). Both services hash with it."""
    return fingerprint if pixels is None else f"{fingerprint}|{pixels.key()}"
