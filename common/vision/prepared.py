"""What a grid tower takes for one image or video (the dynamic-resolution families' encoders, the
encoder service's video path and the decoder's in-process source share it without naming a family)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.image_geometry import Grid
from common.video.rules import VideoTiming


@dataclass(frozen=True)
class PreparedGrid:
    """One image or video ready for the tower: its grid, and one of: patch rows [t*h*w, patch_dim] from
    the HF processor or common/video (fp32, host), an image's uint8 [H, W, 3] pixels for the device-side
    processor, or a video's uint8 [n, H, W, 3] sampled frames, patched on the device
    (common/video/patches.frames_to_rows); a video also has its timing (kept with its cache entry)."""

    grid: Grid
    pixel_values: torch.Tensor | None = None
    raw: torch.Tensor | None = None
    timing: VideoTiming | None = None
    frames: torch.Tensor | None = None
