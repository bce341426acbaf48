"""Qwen2-VL's smart_resize: the size an image (or each video frame, for Qwen2/2.5-VL) is resized to
within a pixel range; the image layout (layout.py) and the video geometry (video_geometry.py) share it."""

from __future__ import annotations

import math

from common.image_geometry import ImageGeometryError

MAX_ASPECT_RATIO = 200  # HF's smart_resize refuses longer/shorter > 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) the image is resized to: multiples of factor, pixels within [min, max], the aspect
    ratio kept as closely as possible (Hugging Face's qwen2_vl smart_resize, the same rounding)."""
    if min(height, width) < 1:
        raise ImageGeometryError(f"image of {width}x{height} pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageGeometryError(
            f"image of {width}x{height} pixels: the aspect ratio must be at most {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
