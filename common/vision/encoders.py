"""The vision encoder of a checkpoint, as its family declares it, and what callers may ask of any encoder
without knowing its family (the encoder service and the decoder's in-process source use this)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common.checkpoint import load_config
from common.image_geometry import NO_PAN_AND_SCAN, CropChoice, ImageGeometryError, ImageSettings


def make_vision_encoder(model_dir: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, preprocess: str = "auto") -> Any:
    """The checkpoint's vision encoder, as its family declares it (common/families/): Qwen3-VL's gives
    [parts, tokens, hidden] per image, Qwen2.5-VL's and LLaVA's [tokens, hidden]."""
    from common.families.registry import family_of

    return family_of(load_config(model_dir)).make_vision_encoder(model_dir, device, dtype, preprocess)


def takes_pixel_ranges(encoder: Any) -> bool:
    """True for an encoder whose images are resized into a pixel range (a dynamic-resolution family's): its
    callers pass each image's PixelRange, and its entries have a grid and a size that follows the image."""
    return getattr(encoder, "takes_pixel_ranges", False) is True


def image_settings(encoder: Any, min_pixels: int = 0, max_pixels: int = 0,
                   pan_and_scan: bool | None = None) -> ImageSettings | None:
    """One image's settings for `encoder` from an ImageInput's options: the encoder's own answer where it
    has one (Gemma 3's crop choice), else a pixel-range encoder's range (within the model's), else None.
    ImageGeometryError for pan_and_scan true on a model without crops, or a range the model refuses."""
    own = getattr(encoder, "image_settings", None)
    if own is not None:
        return own(min_pixels, max_pixels, pan_and_scan)
    if pan_and_scan:
        raise ImageGeometryError(NO_PAN_AND_SCAN)
    if takes_pixel_ranges(encoder):
        return encoder.layout.pixel_range(min_pixels, max_pixels)
    return None


def image_nbytes(encoder: Any, height: int, width: int, pixels: Any = None) -> int:
    """Bytes of the embedding of a height x width image: from its grid where the rows follow the size
    (a pixel range's resize, Qwen-VL; the crops of its shape, Phi-4-MM: `rows_follow_size`; Gemma 3's
    crops where its CropChoice `pixels` gives one), else the encoder's embedding_nbytes (fixed, or the
    largest). ImageGeometryError for a size the model cannot take, so that it is refused before any work."""
    if (takes_pixel_ranges(encoder) or getattr(encoder, "rows_follow_size", False) is True
            or isinstance(pixels, CropChoice)):
        return encoder.nbytes_for(encoder.layout.grid(height, width, pixels))
    return encoder.embedding_nbytes
