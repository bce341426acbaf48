"""Decoding untrusted image bytes with clear errors and limits."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image

# Pillow's own decompression-bomb guard: past this many pixels, open() raises.
Image.MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class ImageError(ValueError):
    """An image that cannot be used; the message says why."""


@dataclass(frozen=True)
class ImageLimits:
    """What one service accepts."""

    max_bytes: int = 32 * 1024 * 1024
    max_side: int = 8192
    max_images_per_request: int = 16


def encode_png(image: Image.Image) -> bytes:
    """PNG bytes of a PIL image (lossless: decoding gives the same pixels, hence the same content hash)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Decode an encoded image file (PNG, JPEG, WebP, GIF first frame, BMP) into RGB.

    Raises ImageError for empty, oversized, truncated or corrupt input, a non-image, or a
    decompression bomb.
    """
    if not data:
        raise ImageError("empty image bytes")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image file of {len(data)} bytes exceeds the limit of {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if max(width, height) > limits.max_side:
                raise ImageError(f"image of {width}x{height} exceeds the maximum side of {limits.max_side}")
            image.seek(0)  # GIF and other animations: the first frame
            image.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"decompression bomb refused: {exc}") from None
    except Exception as exc:  # Pillow raises many types for bad files: all mean "not an image we can use"
        raise ImageError(f"cannot decode image: {type(exc).__name__}: {exc}") from None
    if image.width < 1 or image.height < 1:
        raise ImageError("image has no pixels")
    return image.convert("RGB")
