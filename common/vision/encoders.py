"""The vision encoder of a checkpoint, as its family declares it, and what callers may ask of any encoder
without knowing its family (the encoder service and the decoder's in-process source use this): the
interface is common/families/encoder.py's VisionEncoder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.checkpoint import load_config

if TYPE_CHECKING:
    from common.families.encoder import VisionEncoder


def make_vision_encoder(model_dir: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, preprocess: str = "auto") -> VisionEncoder:
    """The checkpoint's vision encoder, as its family declares it (common/families/): a multi-part
    family's gives [parts, tokens, hidden] per image, the others [tokens, hidden]."""
    from common.families.registry import family_of

    return family_of(load_config(model_dir)).make_vision_encoder(model_dir, device, dtype, preprocess)


def takes_pixel_ranges(encoder: VisionEncoder) -> bool:
    """True for an encoder whose images are resized into a pixel range (a dynamic-resolution family's): its
    callers pass each image's PixelRange, and its entries have a grid and a size that follows the image."""
    return encoder.takes_pixel_ranges

