"""A request's video settings (VideoInput's fps, max_frames, min/max_pixels) applied to a model's video
config within the server's caps: the one function both services resolve them with, so the same request
gives the same config, hence the same content hash (common/video/hashing.py) and the same grid.

0 means the model's default; a request may lower max_frames to any count of at least one temporal patch
and narrow the pixel range inside the model's. The model's max_frames is lowered to the server's
--max-video-frames; a request asking for more is refused (VideoError: INVALID_ARGUMENT).
"""

from __future__ import annotations

import math
from dataclasses import replace

from common.video.limits import VideoError, VideoLimits
from common.video.rules import VideoConfig


def video_request_config(base: VideoConfig, fps: float = 0.0, max_frames: int = 0, min_pixels: int = 0,
                         max_pixels: int = 0, limits: VideoLimits = VideoLimits()) -> VideoConfig:
    """base with a request's settings (0: base's), checked against base's ranges and limits."""
    sampling, geometry = base.sampling, base.geometry
    if fps:
        if not (math.isfinite(fps) and fps > 0):
            raise VideoError(f"fps must be a positive number, not {fps}")
        sampling = replace(sampling, fps=float(fps))
    if max_frames > limits.max_frames:
        raise VideoError(f"max_frames {max_frames} is above the server's limit of {limits.max_frames}")
    top = max_frames or min(sampling.max_frames, limits.max_frames)
    if top < sampling.temporal_patch_size:
        raise VideoError(f"max_frames {top} is below one temporal patch of {sampling.temporal_patch_size} "
                         "frames")
    sampling = replace(sampling, max_frames=top)
    # A min_pixels below the model's is taken, as HF's video processors and vLLM take it, raised to one
    # merged block at least (as for images: common/families/qwen2_5_vl/layout.py).
    lo = max(min_pixels or geometry.min_pixels, geometry.factor * geometry.factor)
    hi = max_pixels or geometry.max_pixels
    if hi > geometry.max_pixels:
        raise VideoError(f"max_pixels {hi} is above the model's {geometry.max_pixels}")
    if lo > hi:
        raise VideoError(f"min_pixels {lo} is above max_pixels {hi}")
    if hi < geometry.factor * geometry.factor:
        raise VideoError(f"max_pixels {hi} is below one {geometry.factor}x{geometry.factor} block")
    return replace(base, sampling=sampling, geometry=replace(geometry, min_pixels=lo, max_pixels=hi))


def video_input_config(base: VideoConfig, video, limits: VideoLimits = VideoLimits()) -> VideoConfig:
    """video_request_config for a VideoInput message (or anything with its four fields)."""
    return video_request_config(base, float(video.fps), int(video.max_frames), int(video.min_pixels),
                                int(video.max_pixels), limits)
