"""A sampled video's size on the model's grid: the resize, the (t, h, w) patch grid and its token count.

As Hugging Face's video processors: every frame is resized to one (height, width), multiples of
factor = patch x merge, by smart_resize with the video's pixel range; frames are grouped by the temporal
patch size (2) along time, the last one repeated to fill a group, so t = ceil(frames / 2); a video takes
t * h * w / merge**2 tokens. The pixel range differs by family:

- Qwen2-VL / Qwen2.5-VL (`Qwen2VLVideoProcessor.resize`): [min_pixels, max_pixels] bounds one frame;
- Qwen3-VL (`Qwen3VLVideoProcessor.resize` and its module's smart_resize): it bounds all frames together
  (round(frames / 2) * 2 frames of h x w), and frames with a side under the factor are first scaled up.

With `cap_pixels_per_frame` (HF's option of that name, off by default in transformers 5.24) max_pixels is
first lowered to each model's share of a whole-video budget, as qwen-vl-utils does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.families.qwen2_5_vl.resize import MAX_ASPECT_RATIO, smart_resize
from common.image_geometry import Grid, ImageGeometryError
from common.video.limits import VideoError

GEOMETRY_FAMILIES = ("qwen2_vl", "qwen3_vl")


def qwen3_vl_smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                          min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) of Qwen3-VL's video smart_resize (video_processing_qwen3_vl.py), the same rounding:
    the pixel range bounds t_bar * h * w, t_bar being num_frames rounded to the temporal factor."""
    if num_frames < temporal_factor:
        raise VideoError(f"{num_frames} frame(s) is fewer than the temporal patch of {temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise VideoError(f"video frames of {width}x{height}: the aspect ratio must be at most "
                         f"{MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class VideoGeometry:
    """The video side of a Qwen VL checkpoint's processor, as far as sizes and token counts go."""

    family: str  # one of GEOMETRY_FAMILIES: which resize rule
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int  # HF's size["shortest_edge"]
    max_pixels: int  # HF's size["longest_edge"]
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000  # HF's default for Qwen2-VL; Qwen3-VL's is 768 (tokens per frame)

    @property
    def timestamped(self) -> bool:
        """The prompt gives each temporal group its own run after its start time (Qwen3-VL's rule)."""
        return self.family == "qwen3_vl"

    def __post_init__(self) -> None:
        if self.family not in GEOMETRY_FAMILIES:
            raise ValueError(f"family must be one of {GEOMETRY_FAMILIES}, not {self.family!r}")

    @property
    def factor(self) -> int:
        """Frame sides are resized to multiples of this many pixels."""
        return self.patch_size * self.merge_size

    def _max_pixels(self, num_frames: int) -> int:
        """max_pixels after the optional whole-video cap, as each family's `resize` computes it."""
        if not self.cap_pixels_per_frame:
            return self.max_pixels
        f2 = self.factor * self.factor
        floor = int(self.min_pixels * 1.05)
        if self.family == "qwen2_vl":
            total = int(self.max_video_tokens * f2 * 0.9)
            return max(min(self.max_pixels, total * self.temporal_patch_size // num_frames), floor)
        per_frame = max(min(self.max_video_tokens * f2, self.max_pixels // num_frames), floor)
        return per_frame * num_frames

    def resized_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) every frame of a video of num_frames sampled frames is resized to."""
        if num_frames < 1 or min(height, width) < 1:
            raise VideoError(f"video of {num_frames} frame(s) of {width}x{height} pixels")
        max_pixels = self._max_pixels(num_frames)
        if self.family == "qwen3_vl":
            return qwen3_vl_smart_resize(num_frames, height, width, self.temporal_patch_size, self.factor,
                                         self.min_pixels, max_pixels)
        try:
            return smart_resize(height, width, self.factor, self.min_pixels, max_pixels)
        except ImageGeometryError as exc:
            raise VideoError(f"video frames: {exc}") from None

    def grid(self, num_frames: int, height: int, width: int) -> Grid:
        """(t, h, w) patch grid of num_frames sampled frames of height x width pixels."""
        rh, rw = self.resized_size(num_frames, height, width)
        t = -(-num_frames // self.temporal_patch_size)  # the last frame repeats to fill a group
        return t, rh // self.patch_size, rw // self.patch_size

    def num_tokens(self, grid: Sequence[int]) -> int:
        """Placeholder tokens (= embedding rows) of a video of this grid."""
        t, h, w = (int(x) for x in grid)
        return t * h * w // (self.merge_size * self.merge_size)

    def tokens_per_group(self, grid: Sequence[int]) -> int:
        """Tokens of one temporal group (Qwen3-VL's prompt puts each group after its timestamp)."""
        _, h, w = (int(x) for x in grid)
        return h * w // (self.merge_size * self.merge_size)

    def key(self) -> str:
        """Part of the content hash: the same frames resized two ways are two cache entries."""
        cap = f"cap={self.max_video_tokens}" if self.cap_pixels_per_frame else "cap=off"
        return (f"resize={self.family};patch={self.patch_size}x{self.merge_size}x{self.temporal_patch_size};"
                f"pixels={self.min_pixels}-{self.max_pixels};{cap}")
