"""The vision encoder of a checkpoint, as its family declares it, and what callers may ask of any encoder
without knowing its family (the encoder service and the decoder's in-process source use this)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common.checkpoint import load_config


def make_vision_encoder(model_dir: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, preprocess: str = "auto") -> Any:
    """The checkpoint's vision encoder, as its family declares it (common/families/): Qwen3-VL's gives
    [parts, tokens, hidden] per image, Qwen2.5-VL's and LLaVA's [tokens, hidden]."""
    from common.families import family_of

    return family_of(load_config(model_dir)).make_vision_encoder(model_dir, device, dtype, preprocess)


def takes_pixel_ranges(encoder: Any) -> bool:
    """True for an encoder whose images are resized into a pixel range (a dynamic-resolution family's): its
    callers pass each image's PixelRange, and its entries have a grid and a size that follows the image."""
    return getattr(encoder, "takes_pixel_ranges", False) is True
