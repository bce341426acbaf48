"""Qwen3-VL's frame timestamps: the prompt gives each temporal group of frames its time, `<t seconds>`.

As `Qwen3VLProcessor._calculate_timestamps` (transformers/models/qwen3_vl/processing_qwen3_vl.py): the
sampled indices are padded with the last one to a multiple of the temporal patch size, each index
becomes index / video_fps seconds, and a group's time is the mean of its first and last frame's;
`replace_video_token` writes it with one decimal before the group's vision tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.video.rules import VideoTiming


def qwen3_vl_timestamps(indices: Sequence[int], video_fps: float,
                        temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal group (one per grid t) of frames sampled at `indices`."""
    idx = [int(i) for i in indices]
    if idx and len(idx) % temporal_patch_size:
        idx.extend(idx[-1] for _ in range(temporal_patch_size - len(idx) % temporal_patch_size))
    seconds = [i / video_fps for i in idx]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(seconds), temporal_patch_size)]


def qwen3_vl_timestamp_text(seconds: float) -> str:
    """The prompt text before one temporal group's tokens, e.g. `<1.2 seconds>`."""
    return f"<{seconds:.1f} seconds>"


def qwen2_5_vl_second_per_grid(num_sampled: int, total_frames: int, video_fps: float,
                               temporal_patch_size: int = 2) -> float:
    """Seconds per temporal group for Qwen2.5-VL's M-RoPE time axis: temporal_patch_size / sampled fps,
    the sampled fps being num_sampled / total_frames * video_fps (HF's VideoMetadata.sampled_fps, used by
    Qwen2_5_VLProcessor._process_videos)."""
    return temporal_patch_size / (num_sampled / total_frames * video_fps)


def video_timing(indices: Sequence[int], total_frames: int, video_fps: float,
                 temporal_patch_size: int = 2) -> VideoTiming:
    """Both timings of frames sampled at indices from a video of total_frames at video_fps."""
    return VideoTiming(tuple(qwen3_vl_timestamps(indices, video_fps, temporal_patch_size)),
                       qwen2_5_vl_second_per_grid(len(indices), total_frames, video_fps, temporal_patch_size))
