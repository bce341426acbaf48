"""Image geometry types every family and service shares: a patch grid, a pixel range, a crop choice, the
error a size the model cannot take raises, and the fingerprint an image's content hash is made under.

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

    def input_fields(self) -> dict[str, int]:
        """The ImageInput fields that ask an encoder for this range."""
        return {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels}


@dataclass(frozen=True)
class CropChoice:
    """Whether one image is also cut into crops besides the whole (Gemma 3's pan-and-scan, per request or
    the checkpoint's), and the crop rule's settings as text (`rule`: they change the crops, so they are
    part of the content hash when crops are on)."""

    on: bool
    rule: str = ""

    def key(self) -> str:
        """Part of the content hash: "" without crops (the plain image's hash), the rule with them."""
        return self.rule if self.on else ""

    def input_fields(self) -> dict[str, bool]:
        """The ImageInput fields that ask an encoder for this choice (always explicit)."""
        return {"pan_and_scan": self.on}


# Image processor settings that only choose an image's default settings (Gemma 3's do_pan_and_scan: the
# CropChoice of an image whose request names none). Every image's key records the choice itself, so the
# model fingerprint leaves these out (common/processor_settings.py): checkpoints that only default
# differently share the entries of images that choose alike.
PER_IMAGE_DEFAULTS = frozenset({"do_pan_and_scan"})


# One image's processor settings that change its embedding (and so its hash): a pixel range (Qwen-VL), a
# crop choice (Gemma 3), or None where the model has none (LLaVA).
ImageSettings = PixelRange | CropChoice


def hash_fingerprint(fingerprint: str, pixels: ImageSettings | None) -> str:
    """The model fingerprint an image's content hash is made under: with its settings where they change
    the embedding (the same bytes resized or cropped two ways are two embeddings; no crops add nothing).
    Both services hash with it."""
    key = pixels.key() if pixels is not None else ""
    return f"{fingerprint}|{key}" if key else fingerprint
