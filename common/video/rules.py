"""What a family's video rules give the shared video code: which frames to sample, the grid and token
count of the sampled frames, how they are normalised, and their timing in the prompt.

The rules themselves are the family's (its layout's `video_config(model_dir)`: common/families/layout.py);
common/video decodes, probes, schedules, patches, hashes and applies a request's settings through this
interface without knowing whose rules they are. A config is a frozen dataclass (a request's settings
are applied with dataclasses.replace).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from common.image_geometry import Grid
from common.video.probe import VideoInfo


@dataclass(frozen=True)
class VideoTiming:
    """A sampled video's place in time, as the decoder needs it to lay the video out in a prompt."""

    timestamps: tuple[float, ...]  # seconds of each temporal group (a timestamped prompt's text)
    second_per_grid: float  # seconds one temporal group spans (an M-RoPE time axis' step)


class SamplingRule(Protocol):
    """Which frames of a video the model sees (a request may change fps and max_frames)."""

    fps: float
    min_frames: int
    max_frames: int
    temporal_patch_size: int

    def indices_for(self, info: VideoInfo) -> np.ndarray:
        """int64 indices of the frames to take from a probed video."""

    def key(self) -> str:
        """Part of the content hash: the same file sampled two ways is two cache entries."""


class GeometryRule(Protocol):
    """A sampled video's size on the model's grid (a request may narrow the pixel range)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    @property
    def factor(self) -> int:
        """Frame sides are resized to multiples of this many pixels."""

    @property
    def timestamped(self) -> bool:
        """The prompt gives each temporal group its own run after its start time."""

    def grid(self, num_frames: int, height: int, width: int) -> Grid:
        """(t, h, w) patch grid of num_frames sampled frames of height x width pixels."""

    def num_tokens(self, grid: Sequence[int]) -> int:
        """Placeholder tokens (= embedding rows) of a video of this grid."""

    def key(self) -> str:
        """Part of the content hash."""


class VideoConfig(Protocol):
    """Everything that turns a video file into a model's patches and tokens."""

    sampling: SamplingRule
    geometry: GeometryRule
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float

    def key(self) -> str:
        """Every parameter that changes a video's patches, for its content hash."""

    def timing(self, indices: Sequence[int], total_frames: int, video_fps: float) -> VideoTiming:
        """The timing of frames sampled at indices from a video of total_frames at video_fps."""
