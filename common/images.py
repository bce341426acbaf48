"""Decoding untrusted image bytes with clear errors and limits."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image

from common.arg_types import positive_int
from common.config import option
from common.errors import InvalidInputError

try:  # libspng: plain 8-bit RGB PNGs (photos, screenshots without alpha) in about two thirds of Pillow's time
    import pyspng
except ImportError:  # pragma: no cover - Pillow decodes everything where the wheel is missing
    pyspng = None

# The formats the contract documents (API.md). Anything else (TIFF, ICO, EPS, ...) is refused from its
# header, before any decoding: Pillow's other plugins are a larger attack surface, and EPS would run
# Ghostscript where it is installed.
DEFAULT_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
KNOWN_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "ICO", "PPM")


def image_format_list(text: str) -> str:
    """An argparse type: a comma-separated list of Pillow format names (normalised to upper case)."""
    names = [n.strip().upper() for n in str(text).split(",") if n.strip()]
    unknown = [n for n in names if n not in KNOWN_IMAGE_FORMATS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{unknown[0] if unknown else text!r}: give formats from {', '.join(KNOWN_IMAGE_FORMATS)}")
    return ",".join(dict.fromkeys(names))

# Pillow's own decompression-bomb guard: past this many pixels, open() raises.
Image.MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class ImageError(InvalidInputError):
    """An image that cannot be used; the message says why."""


@dataclass(frozen=True)
class ImageLimits:
    """What one service accepts."""

    max_bytes: int = option(32 * 1024 * 1024, "largest encoded image, bytes", flag="--max-image-bytes",
                            type=positive_int)
    max_side: int = option(8192, "longest image side, pixels", flag="--max-image-side", type=positive_int)
    # Read from the header, before any pixel is decoded.
    max_pixels: int = option(4096 * 4096, "most pixels in an image", flag="--max-image-pixels",
                             type=positive_int)
    max_images_per_request: int = option(16, "most images in one request", type=positive_int)
    formats: str = option(",".join(DEFAULT_IMAGE_FORMATS), "image formats accepted, checked from the "
                          "file header before decoding", flag="--image-formats", type=image_format_list)

    def __post_init__(self) -> None:
        try:
            image_format_list(self.formats)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--image-formats: {exc}") from None

    @property
    def format_names(self) -> tuple[str, ...]:
        """The accepted formats, as Pillow names them."""
        return tuple(image_format_list(self.formats).split(","))


def encode_png(image: Image.Image) -> bytes:
    """PNG bytes of a PIL image (lossless: decoding gives the same pixels, hence the same content hash)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _public(exc: BaseException) -> str:
    """An exception's message without object reprs (heap addresses stay in the logs, not in answers)."""
    if isinstance(exc, Image.UnidentifiedImageError):
        return "not a recognised image format"
    return re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "<data>", str(exc))


def _open_checked(data: bytes, limits: ImageLimits) -> Image.Image:
    """Image.open (header only) with the byte, side and pixel limits checked before any decoding."""
    if not data:
        raise ImageError("empty image bytes")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image file of {len(data)} bytes exceeds the limit of {limits.max_bytes}")
    allowed = limits.format_names
    try:
        image = Image.open(io.BytesIO(data), formats=allowed)
    except Image.UnidentifiedImageError:
        raise ImageError(f"not an accepted image format (accepted: {', '.join(allowed)})") from None
    width, height = image.size
    if max(width, height) > limits.max_side:
        raise ImageError(f"image of {width}x{height} exceeds the maximum side of {limits.max_side}")
    if width * height > limits.max_pixels:
        raise ImageError(f"image of {width}x{height} has more than the {limits.max_pixels} pixels allowed")
    return image


def check_image_format(data: bytes, formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS) -> str:
    """The file's format, read from its header (nothing decoded); ImageError unless it is in formats."""
    try:
        with Image.open(io.BytesIO(data), formats=formats) as image:
            return image.format or "?"
    except Image.UnidentifiedImageError:
        raise ImageError(f"not an accepted image format (accepted: {', '.join(formats)})") from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad headers
        raise ImageError(f"cannot read the image header: {_public(exc)}") from None


def probe_image_size(data: bytes, limits: ImageLimits = ImageLimits()) -> tuple[int, int]:
    """(height, width) from the file's header, limits checked, nothing decoded. Raises ImageError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = _open_checked(data, limits)
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"decompression bomb refused: {_public(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad files
        raise ImageError(f"cannot decode image: {_public(exc)}") from None
    if image.width < 1 or image.height < 1:
        raise ImageError("image has no pixels")
    return image.height, image.width


@contextlib.contextmanager
def _pillow_errors() -> Iterator[None]:
    """Pillow's many exception types for a bad file, as ImageError (a bomb warning is an error)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"decompression bomb refused: {_public(exc)}") from None
    except Exception as exc:  # all mean "not an image we can use"
        raise ImageError(f"cannot decode image: {_public(exc)}") from None


def _opened(data: bytes, limits: ImageLimits) -> Image.Image:
    """The file's header read (the first frame of an animation), limits checked, nothing decoded."""
    with _pillow_errors():
        image = _open_checked(data, limits)
        image.seek(0)  # GIF and other animations: the first frame
    if image.width < 1 or image.height < 1:
        raise ImageError("image has no pixels")
    return image


def _loaded_rgb(image: Image.Image) -> Image.Image:
    with _pillow_errors():
        image.load()
    return to_rgb(image)


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Decode an encoded image file (PNG, JPEG, WebP, GIF first frame, BMP) into RGB; transparency is
    composited onto white, as transformers' convert_to_rgb does (the processors' do_convert_rgb), so a
    transparent PNG gives the pixels HF's processor would.

    Raises ImageError for empty, oversized, truncated or corrupt input, a non-image, or a
    decompression bomb.
    """
    return _loaded_rgb(_opened(data, limits))


def _plain_rgb_png(image: Image.Image) -> bool:
    """An 8-bit truecolour PNG, not animated, with no transparent colour: libspng's RGB output is then
    exactly Pillow's (lossless; neither applies gamma or colour profiles)."""
    if image.format != "PNG" or image.mode != "RGB" or "transparency" in image.info:
        return False
    if image.get_format_mimetype() != "image/png" or len(image.tile) != 1:  # "image/apng": animated
        return False
    return image.tile[0][3] == "RGB"  # the raw mode: 16-bit samples read "RGB;16B"


def decode_image_array(data: bytes, limits: ImageLimits = ImageLimits()) -> np.ndarray:
    """`decode_image`'s pixels as a C-contiguous uint8 [H, W, 3] array (the same values, the same
    errors). Plain 8-bit RGB PNGs are decoded by libspng (pyspng) when it is installed: 10.6 against 16.4 ms
    for a 1024x1024 noise PNG on one core of the CPU test host; everything else, and any file libspng
    refuses (it checks CRCs Pillow does not), by Pillow."""
    image = _opened(data, limits)
    if pyspng is not None and _plain_rgb_png(image):
        try:
            pixels = pyspng.load(bytes(data), format="RGB")
        except Exception:  # noqa: BLE001 - Pillow decides, and words the error
            pixels = None
        if pixels is not None and pixels.dtype == np.uint8 and pixels.shape == (image.height, image.width, 3):
            return np.ascontiguousarray(pixels)
    return np.asarray(_loaded_rgb(image))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, any transparency (an alpha band, a palette's transparent index) composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")
