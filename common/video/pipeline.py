"""One call from video bytes to what both services need: the sampled frames, the grid and token count
(decoder), the timestamps for the prompt, and the content hash (encoder cache), plus the same without
decoding a frame (`plan_video`: what a service needs before it decides to decode)."""

from __future__ import annotations

from dataclasses import dataclass

from common.image_geometry import Grid
from common.video.decode import DecodedVideo, decode_video, plan_decoding
from common.video.hashing import hash_video_bytes
from common.video.limits import VideoLimits
from common.video.probe import VideoInfo
from common.video.rules import VideoConfig, VideoTiming


@dataclass(frozen=True)
class SampledVideo:
    """A decoded, sampled video and its place in the model's input."""

    decoded: DecodedVideo
    grid: Grid
    num_tokens: int
    timestamps: list[float]  # seconds of each temporal group (Qwen3-VL writes them into the prompt)
    second_per_grid: float  # seconds per temporal group (Qwen2.5-VL's M-RoPE time axis)
    content_hash: str


def read_video(data: bytes, config: VideoConfig, model_fingerprint: str, cache_salt: str = "",
               limits: VideoLimits = VideoLimits()) -> SampledVideo:
    """Check, sample and decode encoded video bytes under config. Raises VideoError (INVALID_ARGUMENT)."""
    video = decode_video(data, config.sampling.indices_for, limits)
    n, height, width, _ = video.frames.shape
    grid = config.geometry.grid(n, height, width)
    timing = config.timing(video.indices, video.info.total_frames, video.info.fps)
    return SampledVideo(
        video, grid, config.geometry.num_tokens(grid), list(timing.timestamps), timing.second_per_grid,
        hash_video_bytes(data, config, model_fingerprint, cache_salt))


@dataclass(frozen=True)
class VideoPlan:
    """A video's header checked and its layout known, no frame decoded yet."""

    info: VideoInfo
    indices: tuple[int, ...]  # the frames to sample
    grid: Grid
    num_tokens: int
    timing: VideoTiming
    content_hash: str
    frames_to_decode: int = 0  # every frame decoding goes through to reach the sampled ones


def plan_video(data: bytes, config: VideoConfig, model_fingerprint: str, cache_salt: str = "",
               limits: VideoLimits = VideoLimits(), content_hash: str | None = None) -> VideoPlan:
    """The header checked against limits, the sampled indices, grid, tokens, timing and content hash of
    encoded video bytes, without decoding a frame (read_video's values); the frames that decoding goes
    through are counted from the packet index and checked against limits too. Raises VideoError.
    content_hash: hash_video_bytes of the same arguments, when the caller has it already."""
    info, sampled, schedule = plan_decoding(data, config.sampling.indices_for, limits)
    indices = tuple(int(i) for i in sampled)
    grid = config.geometry.grid(len(indices), info.height, info.width)
    return VideoPlan(info, indices, grid, config.geometry.num_tokens(grid),
                     config.timing(indices, info.total_frames, info.fps),
                     content_hash or hash_video_bytes(data, config, model_fingerprint, cache_salt),
                     schedule.frames_to_decode)
