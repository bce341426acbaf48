"""Which frames of a video the model sees: Hugging Face's frame sampling for the Qwen VL family.

Both samplers take `fps` frames per second of video, clamped to [min_frames, max_frames] and to the
frames there are; the duration is total_frames / video_fps, as in HF's formula. They differ in rounding:

- Qwen2-VL / Qwen2.5-VL (`Qwen2VLVideoProcessor.sample_frames`,
  transformers/models/qwen2_vl/video_processing_qwen2_vl.py): the count is floored to a multiple of the
  temporal patch size (2), and the indices are `torch.arange(0, total, total / n).int()` (less any index
  past the last frame, which HF's PyAV reader skips);
- Qwen3-VL (`Qwen3VLVideoProcessor.sample_frames`, .../qwen3_vl/video_processing_qwen3_vl.py): the count
  is `int(duration * fps)` (any parity: the patcher repeats the last frame), and the indices are
  `np.linspace(0, total - 1, n).round()`, so the first and last frames are always taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from common.video.limits import VideoError
from common.video.probe import VideoInfo

SAMPLING_METHODS = ("qwen2_vl", "qwen3_vl")


def _check(total_frames: int, video_fps: float, fps: float, temporal_patch_size: int) -> None:
    if not (video_fps > 0 and math.isfinite(video_fps)) or not (fps > 0 and math.isfinite(fps)):
        raise VideoError(f"cannot sample at {fps} fps from a video at {video_fps} fps")
    # HF fails here too (a division by zero for Qwen2-VL, smart_resize's check for Qwen3-VL).
    if total_frames < temporal_patch_size:
        raise VideoError(f"video of {total_frames} frame(s) is shorter than one temporal patch of "
                         f"{temporal_patch_size} frames")


def qwen2_vl_frame_indices(total_frames: int, video_fps: float, fps: float = 2.0, min_frames: int = 4,
                           max_frames: int = 768, temporal_patch_size: int = 2) -> np.ndarray:
    """The frame indices Qwen2VLVideoProcessor.sample_frames takes with `fps` (Qwen2-VL, Qwen2.5-VL)."""
    _check(total_frames, video_fps, fps, temporal_patch_size)
    tps = temporal_patch_size
    max_frames = math.floor(min(max_frames, total_frames) / tps) * tps
    num = total_frames / video_fps * fps
    num = min(max(num, min_frames), max_frames, total_frames)
    num = math.floor(num / tps) * tps
    # torch's float32 arange, as HF computes it: its rounding decides the truncated indices, and its
    # length, ceil(total / step) in float64, is num + 1 for some counts. That extra index is then `total`
    # itself (17 frames, num 14: 0, 1, ..., 15, 17), past the last frame: HF's PyAV reader never meets it
    # and returns the frames at the other indices, so we drop it too.
    indices = torch.arange(0, total_frames, total_frames / num).int().numpy().astype(np.int64)
    return indices[indices < total_frames]


def qwen3_vl_frame_indices(total_frames: int, video_fps: float, fps: float = 2, min_frames: int = 4,
                           max_frames: int = 768, temporal_patch_size: int = 2) -> np.ndarray:
    """The frame indices Qwen3VLVideoProcessor.sample_frames takes with `fps`."""
    _check(total_frames, video_fps, fps, temporal_patch_size)
    num = int(total_frames / video_fps * fps)
    num = min(max(num, min_frames), max_frames, total_frames)
    return np.linspace(0, total_frames - 1, num).round().astype(np.int64)


@dataclass(frozen=True)
class FrameSampling:
    """A model's sampling rule and its parameters (a request may change fps and max_frames)."""

    method: str  # one of SAMPLING_METHODS
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    temporal_patch_size: int = 2

    def __post_init__(self) -> None:
        if self.method not in SAMPLING_METHODS:
            raise ValueError(f"sampling method must be one of {SAMPLING_METHODS}, not {self.method!r}")
        if not (self.fps > 0 and math.isfinite(self.fps)):
            raise VideoError(f"fps must be a positive number, not {self.fps}")
        if self.min_frames < 1 or self.max_frames < self.temporal_patch_size:
            raise VideoError(f"min_frames {self.min_frames} / max_frames {self.max_frames}: need "
                             f"min_frames >= 1 and max_frames >= {self.temporal_patch_size}")

    def indices(self, total_frames: int, video_fps: float) -> np.ndarray:
        """int64 indices of the frames to take from a video of total_frames at video_fps."""
        fn = qwen2_vl_frame_indices if self.method == "qwen2_vl" else qwen3_vl_frame_indices
        return fn(total_frames, video_fps, self.fps, self.min_frames, self.max_frames,
                  self.temporal_patch_size)

    def indices_for(self, info: VideoInfo) -> np.ndarray:
        """The indices for a probed video (the `sample` argument of decode_video)."""
        return self.indices(info.total_frames, info.fps)

    def key(self) -> str:
        """Part of the content hash: the same file sampled two ways is two cache entries."""
        return (f"sample={self.method};fps={self.fps!r};frames={self.min_frames}-{self.max_frames};"
                f"tps={self.temporal_patch_size}")
